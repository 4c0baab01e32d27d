"""longctx: train hybrid long-context sparse models (KDA + DSA + MoE + mHC) at 1M+ tokens."""

from .config import PRESETS, ModelConfig, preset
from .errors import CheckpointError, ConfigError, DataError, UserError

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing the config must not pull in the model (and torch kernels) for the CLI's --help.
    if name in ("LongCtxModel", "build_model"):
        from . import model
        return getattr(model, name)
    if name in ("load_pretrained", "export_hf", "save_checkpoint_dir"):
        from . import hf_interop
        return getattr(hf_interop, name)
    raise AttributeError(name)


__all__ = ["ModelConfig", "preset", "PRESETS", "LongCtxModel", "build_model", "load_pretrained", "export_hf",
           "save_checkpoint_dir", "UserError", "ConfigError", "CheckpointError", "DataError"]
