"""Typed, validated configuration: the model (`model.py`) and the training run (`train.py`)."""

from .model import PRESETS, ModelConfig, preset

__all__ = ["PRESETS", "ModelConfig", "preset"]
