"""The device and dtype a run's `device` and `dtype` settings name, for the trainer and the memory
planner alike (the planner sizes activations by the dtype the trainer will run)."""

from __future__ import annotations

import torch

from .errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device is 'cuda' but no CUDA GPU is visible; set device=auto or device=cpu.")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
