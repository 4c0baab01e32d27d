"""The loss_impl / residual_impl switches on the CPU: auto runs torch, liger refuses with a ConfigError,
the liger wrappers' argument checks. (The liger-vs-torch comparisons are the GPU tests
test_gpu_fused_loss.py and test_gpu_mhc.py.)"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from longctx import errors
from longctx.config import preset
from longctx.errors import ConfigError
from longctx.layers.residual import MHC
from longctx.model import LongCtxModel
from longctx.ops.loss import liger as fused_loss
from longctx.ops.mhc import liger as mhc_liger


def _tiny(**kw):
    torch.manual_seed(0)
    return LongCtxModel(preset("tiny").replace(**kw))


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 33), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    return ids[:, :-1], labels


# ------------------------------------------------------------------------------------ loss_impl
def test_auto_on_cpu_runs_the_torch_chunked_head_and_matches_torch():
    model = _tiny()
    model.loss_chunk = 16
    ids, labels = _batch()
    assert model.loss_impl == "auto"
    auto = model(ids, labels=labels, token_losses=True)
    assert model.last_impl == "loss:torch-chunked"
    assert "loss:torch-chunked x1" in model.impl_report()
    model.loss_impl = "torch"
    ref = model(ids, labels=labels, token_losses=True)
    assert torch.equal(auto.token_losses, ref.token_losses) and torch.equal(auto.lm_loss, ref.lm_loss)
    assert (auto.token_losses[0, :5] == 0).all()
    model.loss_chunk = None
    model(ids, labels=labels)
    assert model.last_impl == "loss:torch"


def test_liger_on_cpu_raises_config_error_naming_setting_and_fix():
    model = _tiny()
    model.loss_impl = "liger"
    ids, labels = _batch()
    with pytest.raises(ConfigError, match=r"loss_impl 'liger' needs CUDA.*set loss_impl to 'auto' or 'torch'"):
        model(ids, labels=labels)


def test_unknown_loss_impl_raises():
    model = _tiny()
    model.loss_impl = "fused"
    ids, labels = _batch()
    with pytest.raises(ConfigError, match="loss_impl must be one of auto, torch, liger"):
        model(ids, labels=labels)


def test_auto_on_cuda_without_liger_warns_once_and_runs_torch(monkeypatch):
    fake_cuda = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(fused_loss, "liger_available", lambda: False)
    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())
    with pytest.warns(RuntimeWarning, match="liger-kernel is not importable"):
        assert fused_loss.resolve_loss_impl("auto", fake_cuda) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused_loss.resolve_loss_impl("auto", fake_cuda) == "torch"  # once only
    with pytest.raises(ConfigError, match="loss_impl .liger."):
        fused_loss.resolve_loss_impl("liger", fake_cuda)
    # loss_chunk off (the baseline plan) keeps auto on the plain head, liger or not
    monkeypatch.setattr(fused_loss, "liger_available", lambda: True)
    assert fused_loss.resolve_loss_impl("auto", fake_cuda, chunked=False) == "torch"
    assert fused_loss.resolve_loss_impl("auto", fake_cuda) == "liger"
    assert fused_loss.resolve_loss_impl("torch", fake_cuda) == "torch"


def test_loss_wrapper_argument_checks():
    h, w, y = torch.randn(8, 16), torch.randn(32, 16), torch.randint(0, 32, (8,))
    check = fused_loss.check_loss_args
    with pytest.raises(ValueError, match=r"hidden \[N, D\].*hidden \(2, 4, 16\)"):
        check(h.view(2, 4, 16), w, y)
    with pytest.raises(ValueError, match=r"hidden \(8, 16\) and weight \(32, 12\) disagree on D"):
        check(h, torch.randn(32, 12), y)
    with pytest.raises(ValueError, match=r"labels \(2, 4\) must be \[N\] = \[8\]"):
        check(h, w, y.view(2, 4))
    with pytest.raises(ValueError, match="N >= 1"):
        check(h[:0], w, y[:0])
    with pytest.raises(ValueError, match="labels must be int64"):
        check(h, w, y.float())
    with pytest.raises(ValueError, match="weight must be bf16, fp16 or fp32"):
        check(h, w.double(), y)
    with pytest.raises(ValueError, match="runs on one CUDA device; got hidden on cpu"):
        check(h, w, y)  # everything else is right: only the device is refused
    with pytest.raises(ValueError, match=r"label 40 is outside \[0, 32\)"):
        fused_loss._check_label_range(torch.tensor([1, -100, 40]), 32, -100)
    fused_loss._check_label_range(torch.tensor([0, -100, 31]), 32, -100)


def test_version_parsing():
    v = fused_loss._version_tuple
    assert v("0.8.5") == (0, 8, 5) and v("0.8.5.dev0+g1234") == (0, 8, 5) and v("0.10.0rc1") == (0, 10, 0)
    assert v("0.8.4") < v(fused_loss.LIGER_MIN_VERSION) <= v("0.9.0")


def test_liger_import_error_names_the_cause(monkeypatch):
    def broken():
        raise ImportError("no module named liger_kernel")

    assert fused_loss.liger_import_error(broken, "x") == "ImportError: no module named liger_kernel"
    monkeypatch.setattr(fused_loss, "liger_version", lambda: "0.8.4")
    assert "0.8.5 or newer is needed (its mHC ops)" in fused_loss.liger_import_error(lambda: None, "its mHC ops")
    monkeypatch.setattr(fused_loss, "liger_version", lambda: "0.8.5")
    assert fused_loss.liger_import_error(lambda: None, "x") is None


# -------------------------------------------------------------------------------- residual_impl
def test_mhc_auto_on_cpu_is_torch_and_liger_raises():
    model = _tiny()
    ids, labels = _batch()
    model(ids, labels=labels)
    mhcs = [m for m in model.modules() if isinstance(m, MHC)]
    assert mhcs and {m.last_impl for m in mhcs} == {"mhc:torch"}
    assert f"mhc:torch x{len(mhcs)}" in model.impl_report()
    for m in mhcs:
        m.impl = "liger"
    with pytest.raises(ConfigError, match=r"residual_impl 'liger' needs CUDA.*set residual_impl to 'auto' or 'torch'"):
        model(ids, labels=labels)
    for m in mhcs:
        m.impl = "nope"
    with pytest.raises(ConfigError, match="residual_impl must be one of auto, torch, liger"):
        model(ids, labels=labels)


def test_mhc_pick_impl_rules(monkeypatch):
    from longctx.layers import residual

    mhc = MHC(preset("tiny"))
    fake_cuda = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())
    assert residual.AUTO_USES_LIGER is True  # auto takes liger on CUDA since tests/ops/test_mhc_gpu.py held on the H200
    monkeypatch.setattr(residual, "AUTO_USES_LIGER", False)
    assert mhc.pick_impl(fake_cuda) == "torch"
    monkeypatch.setattr(residual, "AUTO_USES_LIGER", True)
    monkeypatch.setattr(mhc_liger, "liger_mhc_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="liger-kernel is not importable"):
        assert mhc.pick_impl(fake_cuda) == "torch"
    monkeypatch.setattr(mhc_liger, "liger_mhc_available", lambda: True)
    assert mhc.pick_impl(fake_cuda) == "liger"
    mhc.recompute_cast = False  # the baseline plan: auto stays plain torch
    assert mhc.pick_impl(fake_cuda) == "torch"
    mhc.recompute_cast = True
    mhc.n = 3
    with pytest.warns(RuntimeWarning, match="power-of-two hc_streams"):
        assert mhc.pick_impl(fake_cuda) == "torch"
    mhc.impl = "liger"
    with pytest.raises(ConfigError, match="hc_streams a power of two"):
        mhc.pick_impl(fake_cuda)


def test_mhc_wrapper_argument_checks():
    n, D = 4, 8
    M = (2 + n) * n
    s = torch.randn(2, 3, n, D)
    fn, base, scale = torch.randn(M, n * D), torch.zeros(M), torch.ones(3)
    check = mhc_liger.check_mhc_args
    with pytest.raises(ValueError, match=r"streams \[\.\.\., n, D\]; got \(4, 8\)"):
        check(s[0, 0], fn, base, scale, 20)
    with pytest.raises(ConfigError, match=r"power of two <= 16 \(streams \(2, 3, 3, 8\) have n = 3\)"):
        check(torch.randn(2, 3, 3, D), fn, base, scale, 20)
    with pytest.raises(ConfigError, match="hc_sinkhorn_iters >= 1"):
        check(s, fn, base, scale, 0)
    with pytest.raises(ValueError, match=r"fn \(24, 16\) must be \[\(2\+n\)n, nD\] = \[24, 32\]"):
        check(s, fn[:, :16], base, scale, 20)
    with pytest.raises(ValueError, match=r"base \(23,\) must be \[24\]"):
        check(s, fn, base[:-1], scale, 20)
    with pytest.raises(ValueError, match="one CUDA device; got streams on cpu"):
        check(s, fn, base, scale, 20)
