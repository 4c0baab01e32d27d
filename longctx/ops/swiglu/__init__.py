"""Clamped SwiGLU: the fused Triton kernel (`triton.py`) beside the plain-torch twin."""
