"""The training loop (`trainer.py`), held-out per-position evaluation (`evaluate.py`) and plots."""
