"""The kernels.loss / kernels.mhc settings on the CPU: auto runs torch, liger refuses with a ConfigError,
auto on CUDA without liger warns and runs torch, the liger wrappers' argument checks. (The liger-vs-torch
comparisons are the GPU tests tests/ops/test_loss_gpu.py and tests/ops/test_mhc_gpu.py.)"""

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
from longctx.ops import loss as loss_ops
from longctx.ops.loss import liger as fused_loss
from longctx.ops.mhc import liger as mhc_liger

FAKE_CUDA = types.SimpleNamespace(is_cuda=True, device="cuda:0")


def _cuda_without(monkeypatch, module):
    """A CUDA machine (as the rule sees it) where `module`'s liger ops do not import."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module, "import_error", lambda: "ImportError: no module named liger_kernel")
    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())


def _tiny(**kw):
    torch.manual_seed(0)
    return LongCtxModel(preset("tiny").replace(**kw))


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 33), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    return ids[:, :-1], labels


# ------------------------------------------------------------------------------------ kernels.loss
def test_auto_on_cpu_runs_the_torch_chunked_head_and_matches_torch():
    model = _tiny()
    model.loss_chunk = 16
    ids, labels = _batch()
    assert model.kernels["loss"] == "auto"
    auto = model(ids, labels=labels, token_losses=True)
    assert model.last_impl == "loss:torch-chunked"
    assert "loss:torch-chunked x1" in model.impl_report()
    model.kernels["loss"] = "torch"
    ref = model(ids, labels=labels, token_losses=True)
    assert torch.equal(auto.token_losses, ref.token_losses) and torch.equal(auto.lm_loss, ref.lm_loss)
    assert (auto.token_losses[0, :5] == 0).all()
    model.loss_chunk = None
    model(ids, labels=labels)
    assert model.last_impl == "loss:torch"


def test_liger_on_cpu_raises_config_error_naming_setting_and_fix():
    model = _tiny()
    model.kernels["loss"] = "liger"
    ids, labels = _batch()
    with pytest.raises(ConfigError, match=r"kernels.loss = 'liger' cannot run here .*CUDA.*set kernels.loss to 'auto' "
                                          "or 'torch'"):
        model(ids, labels=labels)


def test_unknown_loss_impl_raises():
    model = _tiny()
    model.kernels["loss"] = "fused"
    ids, labels = _batch()
    with pytest.raises(ConfigError, match="kernels.loss must be one of auto, torch, liger"):
        model(ids, labels=labels)


def test_auto_on_cuda_without_liger_warns_once_and_runs_torch(monkeypatch):
    _cuda_without(monkeypatch, fused_loss)
    with pytest.warns(RuntimeWarning, match="kernels.loss auto runs the plain-torch twin on CUDA .*liger-kernel.*does "
                                            "not import"):
        assert loss_ops.pick("auto", FAKE_CUDA) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loss_ops.pick("auto", FAKE_CUDA) == "torch"  # once only
    with pytest.raises(ConfigError, match="kernels.loss = 'liger' cannot run here .*does not import"):
        loss_ops.pick("liger", FAKE_CUDA)
    # loss_chunk off (the baseline plan) keeps auto on the plain head, liger or not
    monkeypatch.setattr(fused_loss, "import_error", lambda: None)
    assert loss_ops.pick("auto", FAKE_CUDA, chunked=False) == "torch"
    assert loss_ops.pick("auto", FAKE_CUDA) == "liger"
    assert loss_ops.pick("torch", FAKE_CUDA) == "torch"


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


# -------------------------------------------------------------------------------- kernels.mhc
def test_mhc_auto_on_cpu_is_torch_and_liger_raises():
    model = _tiny()
    ids, labels = _batch()
    model(ids, labels=labels)
    mhcs = [m for m in model.modules() if isinstance(m, MHC)]
    assert mhcs and {m.last_impl for m in mhcs} == {"mhc:torch"}
    assert f"mhc:torch x{len(mhcs)}" in model.impl_report()
    for m in mhcs:
        m.kernels["mhc"] = "liger"
    with pytest.raises(ConfigError, match=r"kernels.mhc = 'liger' cannot run here .*CUDA.*set kernels.mhc to 'auto' "
                                          "or 'torch'"):
        model(ids, labels=labels)
    for m in mhcs:
        m.kernels["mhc"] = "nope"
    with pytest.raises(ConfigError, match="kernels.mhc must be one of auto, torch, liger"):
        model(ids, labels=labels)


def test_mhc_pick_rules(monkeypatch):
    """auto on CUDA: liger where it imports and the streams suit its kernels and the plan casts in backward
    (recompute_cast), else torch, with a warning where it was a fast path declined; liger asked for where
    it cannot run is a ConfigError."""
    mhc = MHC(preset("tiny"))
    _cuda_without(monkeypatch, mhc_liger)
    with pytest.warns(RuntimeWarning, match="kernels.mhc auto runs the plain-torch twin on CUDA .*does not import"):
        assert mhc.pick(FAKE_CUDA) == "torch"
    monkeypatch.setattr(mhc_liger, "import_error", lambda: None)
    assert mhc.pick(FAKE_CUDA) == "liger"
    mhc.recompute_cast = False  # the baseline plan: auto stays plain torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mhc.pick(FAKE_CUDA) == "torch"
    mhc.recompute_cast = True
    mhc.cfg = preset("tiny").replace(hc_streams=3)
    with pytest.warns(RuntimeWarning, match="power of two <= 16, not 3"):
        assert mhc.pick(FAKE_CUDA) == "torch"
    mhc.kernels["mhc"] = "liger"
    with pytest.raises(ConfigError, match="kernels.mhc = 'liger' cannot run here .*hc_streams a power of two"):
        mhc.pick(FAKE_CUDA)


def test_mhc_projection_rule():
    """Our coefficient projection for up to 8 streams (its tiles fit the SM's shared memory), liger's beyond."""
    assert [mhc_liger.projection(n) for n in (1, 2, 4, 8, 16)] == ["triton"] * 4 + ["liger"]


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
