"""mHC residual maths: liger-kernel's Triton ops (`liger.py`) and our coefficient projection (`triton.py`)."""
