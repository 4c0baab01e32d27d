"""Measuring tools: the per-tensor memory meter (`meter.py`) and per-phase CUDA peaks (`peak.py`)."""
