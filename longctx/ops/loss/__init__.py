"""The LM head + cross entropy: the chunked plain-torch twin and liger-kernel's fused kernel (`liger.py`)."""
