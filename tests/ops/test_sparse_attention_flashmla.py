"""kernels.sparse_attention = "flashmla": when it runs, when auto takes it, and the sentence where it cannot.
FlashMLA itself runs on the GPU only (tests/ops/test_sparse_attention_flashmla_gpu.py compares it with the twin)."""

from __future__ import annotations

import pytest
import torch

from longctx.config import preset
from longctx.config.kernels import KernelConfig
from longctx.errors import ConfigError
from longctx.kernels import apply_kernels, planned
from longctx.model import LongCtxModel
from longctx.ops import sparse_attention as sparse_ops
from longctx.ops.sparse_attention import flashmla


def _installed(monkeypatch, sm90: bool = True):
    """A machine (as the rule sees it) where flash_mla imports, on an SM90 GPU or not."""
    monkeypatch.setattr(flashmla, "import_error", lambda: None)
    monkeypatch.setattr(flashmla, "device_problem", lambda dev: None if sm90 else "its SM90 kernels run on sm_90 and "
                                                                               "this GPU is sm_100")


def test_explicit_flashmla_on_the_cpu_is_one_sentence_before_any_step():
    model = LongCtxModel(preset("tiny"))
    with pytest.raises(ConfigError, match=r"kernels.sparse_attention = 'flashmla' cannot run here \(it runs on CUDA "
                                          r"tensors, and these are on cpu\); set kernels.sparse_attention to 'auto' or "
                                          "'torch'"):
        apply_kernels(model, KernelConfig(sparse_attention="flashmla"))
    assert KernelConfig.from_dict({"sparse_attention": "flashmla"}).sparse_attention == "flashmla"


def test_without_the_package_the_reason_names_the_install(monkeypatch):
    monkeypatch.setattr(flashmla, "import_error", lambda: "ModuleNotFoundError: No module named 'flash_mla'")
    why = sparse_ops.unavailable("cuda", preset("glm-5.3-flash"), impl="flashmla")
    assert "sgl-flash-mla does not import" in why and "pip install --no-deps sgl-flash-mla" in why
    with pytest.raises(ConfigError, match="kernels.sparse_attention = 'flashmla' cannot run here .*sgl-flash-mla"):
        planned(KernelConfig(sparse_attention="flashmla"), "cuda", preset("glm-5.3-flash"))
    assert sparse_ops.auto_backend("cuda", preset("glm-5.3-flash")) == "triton"


def test_auto_takes_flashmla_only_where_it_was_measured_faster(monkeypatch):
    """From 64 heads, bf16, latent width 512, on SM90 where it imports; h200-ref's 16 heads stay on Triton."""
    _installed(monkeypatch)
    glm, ref = preset("glm-5.3-flash"), preset("h200-ref")
    assert sparse_ops.auto_backend("cuda", glm) == "flashmla"
    assert sparse_ops.auto_backend("cuda", ref) == "triton"  # 16 heads: padding to 64 is slower
    assert sparse_ops.auto_backend("cuda", heads=64, width=512, dtype=torch.float32) == "triton"
    assert sparse_ops.auto_backend("cuda", heads=64, width=576) == "triton"
    assert sparse_ops.auto_backend("cuda", heads=256, width=512) == "triton"
    assert sparse_ops.auto_backend("cpu", glm) == "triton"
    if not torch.cuda.is_available():
        assert planned(KernelConfig(), "cuda", glm)["sparse_attention"] == "flashmla"
        assert planned(KernelConfig(), "cuda", ref)["sparse_attention"] == "triton"
        assert planned(KernelConfig(sparse_attention="triton"), "cuda", glm)["sparse_attention"] == "triton"
        assert planned(KernelConfig(sparse_attention="flashmla"), "cuda", ref)["sparse_attention"] == "flashmla"
    assert planned(KernelConfig(), "cpu", glm)["sparse_attention"] == "torch"
    _installed(monkeypatch, sm90=False)
    assert sparse_ops.auto_backend("cuda", glm) == "triton"
    assert "sm_100" in sparse_ops.unavailable("cuda", glm, impl="flashmla")


def test_shapes_it_cannot_take_are_named():
    assert flashmla.shape_problem(64, 512) is None and flashmla.shape_problem(16, 512) is None
    assert "at most 128" in flashmla.shape_problem(192, 512)
    assert "latent width 256" in flashmla.shape_problem(64, 256)
    assert "takes bfloat16" in flashmla.shape_problem(64, 512, torch.float32)
    q, kv, idx = torch.zeros(1, 4, 64, 256), torch.zeros(1, 4, 256), torch.zeros(1, 4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sparse_attention_flashmla: cannot take q \(1, 4, 64, 256\).*latent width 256"):
        flashmla.sparse_attention_fwd_flashmla(q, kv, idx, 0.1)
    with pytest.raises(ValueError, match=r"expected q \[B,S,H,D\]"):
        flashmla.sparse_attention_fwd_flashmla(q[0], kv, idx, 0.1)
