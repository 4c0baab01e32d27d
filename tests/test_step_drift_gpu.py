"""The GPU tests' own logic, run on the CPU: what a GPU test asserts about messages and layouts must
hold for the reference itself, or the scarce GPU time is spent finding a bug in the test."""

from __future__ import annotations

import pytest
import torch

from longctx.errors import ConfigError


def test_fused_loss_refusal_patterns_match_the_messages():
    """tests/ops/test_loss_gpu.py::test_liger_refuses_cpu_tensors_and_bad_labels: its Head with
    kernels.loss 'liger' on CPU hidden states raises the ConfigError its pattern names, and the label range
    check says what the test expects."""
    from test_loss_gpu import CPU_REFUSAL, D, Head, V

    from longctx.ops.loss import liger as fused_loss

    head = Head(torch.zeros(V, D, dtype=torch.bfloat16), "liger")
    with pytest.raises(ConfigError, match=CPU_REFUSAL):
        head.chunked_token_losses(torch.zeros(1, 4, D, dtype=torch.bfloat16), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"label 40000 is outside \[0, 32768\)"):
        fused_loss._check_label_range(torch.tensor([0, 1, -100, 40000]), V, -100)


def test_chunked_vs_whole_comparison_runs_and_holds_on_the_cpu():
    """tests/memory/test_sequence_chunks_gpu.py's comparison, run with the tiny model on the CPU (bf16 autocast):
    its logic (routing recorded, replayed in both sweeps and in the fp32 reference) and its criterion."""
    import dataclasses

    from test_sequence_chunks_gpu import assert_as_exact_as_whole, compare_chunked_with_whole

    from longctx.config import preset
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    model = LongCtxModel(dataclasses.replace(preset("tiny"), index_heads=16)).train()
    r = compare_chunked_with_whole(model, 512, 128)
    assert "moe:" in r["impl"] and r["whole_vs_fp32"] > 1e-3  # bf16 really ran; fp32 really differs
    assert_as_exact_as_whole(r)


def test_step_drift_runs_on_the_cpu_and_tells_paths_apart():
    """tests/gpu_step_drift.py (the norms' and SwiGLU's GPU model-step tests): on the CPU, with bf16
    autocast, two runs of the same path drift from fp32 by the same amount, each run's step log names the
    path it set, and the fp32 step (plain torch) is a real reference: the drift is above zero."""
    from gpu_step_drift import set_kernel, step_drift

    def both_torch(m, impl):
        set_kernel(m, "rms_norm", "torch")
        set_kernel(m, "swiglu", "torch")

    r = step_drift(both_torch, impls=("a", "b"), device="cpu")
    assert r["a"]["err"] == r["b"]["err"] and 0 < r["a"]["err"] < 0.5, r
    assert "norm:torch" in r["a"]["report"] and "swiglu:torch" in r["a"]["report"]
    assert r["a"]["loss_err"] < 5e-2


def test_hf_fp32_comparison_runs_on_the_cpu(tmp_path):
    """tests/test_hf_fp32_gpu.py's comparison on the tiny checkpoint, on the CPU: with transformers' choices
    replayed longctx's logits are fp32 rounding away (~1e-5), replay really forces them (random experts move the
    logits by O(1)), and transformers' KDA functions are their torch bodies inside hf_torch_path only."""
    pytest.importorskip("transformers.models.glm5_next")
    from hf_parity import forced_decisions, hf_decisions, hf_torch_path, torch_body
    from hf_reference import make_checkpoint
    from test_hf_fp32_gpu import MAX_LOGIT, compare
    from transformers.models.glm5_next import modeling_glm5_next as m

    from longctx.hf_interop import load_pretrained
    from longctx.kernels import plain_torch

    r = compare(tmp_path, "cpu", 60, {})
    assert r["forced"]["max_logit"] <= 1e-4 < MAX_LOGIT and r["forced"]["max_abs_ref"] > 1.0, r
    assert r["flips"] and not any(r["flips"].values()), r  # every MoE and indexer layer compared, none flipped

    bound = m.chunk_kimi_delta_attention
    with hf_torch_path():
        assert m.chunk_kimi_delta_attention is torch_body(bound) is not bound
    assert m.chunk_kimi_delta_attention is bound
    hf = make_checkpoint(tmp_path / "hf2", seed=0)
    ours = load_pretrained(str(tmp_path / "hf2")).eval()
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    # transformers binds fla's chunk_kda for its KDA wherever fla imports (a GPU machine), and fla takes no
    # CPU tensors: the reference runs on transformers' torch functions here too
    with torch.no_grad(), hf_torch_path(), hf_decisions(hf) as rec:
        ref = hf(input_ids=ids).logits
    rec["experts"] = {i: torch.randint(0, 4, e.shape, generator=torch.Generator().manual_seed(i))
                      for i, e in rec["experts"].items()}
    with torch.no_grad(), plain_torch(ours), forced_decisions(ours, rec):
        assert (ours(ids).logits - ref).abs().max() > 0.1
