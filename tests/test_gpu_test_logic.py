"""The GPU tests' own logic, run on the CPU: what a GPU test asserts about messages and layouts must
hold for the reference itself, or the scarce GPU time is spent finding a bug in the test."""

from __future__ import annotations

import pytest
import torch

from longctx.errors import ConfigError


def test_fused_loss_refusal_patterns_match_the_messages():
    """tests/test_gpu_fused_loss.py::test_liger_refuses_cpu_tensors_and_bad_labels: its Head with
    loss_impl 'liger' on CPU hidden states raises the ConfigError its pattern names (a first version
    expected "model.loss_impl ...", which the message never said), and the label range check says
    what the test expects."""
    from test_gpu_fused_loss import CPU_REFUSAL, D, V, Head

    from longctx.ops import fused_loss

    head = Head(torch.zeros(V, D, dtype=torch.bfloat16), "liger")
    with pytest.raises(ConfigError, match=CPU_REFUSAL):
        head.chunked_token_losses(torch.zeros(1, 4, D, dtype=torch.bfloat16), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"label 40000 is outside \[0, 32768\)"):
        fused_loss._check_label_range(torch.tensor([0, 1, -100, 40000]), V, -100)
