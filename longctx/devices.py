"""The device and dtype a run's `device` and `dtype` settings name, for the trainer and the memory
planner alike (the planner sizes activations by the dtype the trainer will run)."""

from __future__ import annotations

import torch

from .errors import ConfigError


def resolve_device(name: str, setting: str = "device") -> torch.device:
    """`name` (auto, cpu, cuda, cuda:N) as torch's device; a CUDA device this machine lacks is the user's
    mistake, said with the `setting` that named it (the config's `device`, the CLI's `--device`)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"{setting} {name} needs a CUDA GPU, and none is visible; set {setting} auto or cpu.")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{setting} {name} names GPU {index}, but only {torch.cuda.device_count()} are visible; "
                              f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}.")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
