"""Typed, validated configuration: the model (`model.py`), the training run (`train.py`), and reading
one from a preset, a file and `--set` overrides (`loading.py`)."""

from .model import PRESETS, ModelConfig, preset

__all__ = ["PRESETS", "ModelConfig", "preset"]
