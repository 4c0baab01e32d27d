"""The one kernel-selection mechanism (longctx/kernels.py, longctx/config/kernels.py): every op's values
defined once beside it, one function that sets them on a model, one that says what will run."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from longctx.config import preset
from longctx.config.kernels import OPS, KernelConfig
from longctx.errors import ConfigError
from longctx.kernels import _UNAVAILABLE, apply_kernels, ops_of, plain_torch, planned
from longctx.model import LongCtxModel


def _settings(model) -> dict:
    """{op: the set of settings the model's modules hold for it}."""
    out: dict = {}
    for m in model.modules():
        for op, v in (getattr(m, "kernels", None) or {}).items():
            out.setdefault(op, set()).add(v)
    return out


def test_every_op_is_one_field_with_its_values_defined_beside_it():
    fields = [f.name for f in dataclasses.fields(KernelConfig)]
    assert fields == list(OPS) == list(_UNAVAILABLE)
    for op, pkg in OPS.items():
        assert pkg.__name__.startswith("longctx.ops.") and pkg.IMPLS[:2] == ("auto", "torch") and len(pkg.IMPLS) in (3, 4), op
    assert KernelConfig.every("torch").to_dict() == dict.fromkeys(fields, "torch")


def test_op_packages_import_without_triton_fla_or_liger():
    """A CPU install may have none of the fast paths' libraries: the op packages, the config and the planner
    import, and plan the torch twins on the CPU."""
    code = ("import sys\nfor m in ('triton', 'fla', 'liger_kernel'): sys.modules[m] = None\n"
            "from longctx.ops import indexer, kda, loss, mhc, rms_norm, sparse_attention, swiglu\n"
            "from longctx.config import preset\nfrom longctx.config.kernels import KernelConfig\n"
            "from longctx.kernels import planned\n"
            "assert set(planned(KernelConfig(), 'cpu', preset('tiny')).values()) == {'torch'}\n"
            "print(rms_norm.unavailable('cuda'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_config_reads_the_ops_values_without_torch():
    """longctx.config stays torch-free (the CLI's --print-config and config errors need no torch): the op
    packages define their values and load their twins only when one is used."""
    code = ("import sys\nsys.modules['torch'] = None\n"
            "from longctx.config.kernels import KernelConfig\nfrom longctx.config.loading import load_train_config\n"
            "from longctx.ops import indexer, kda, loss, mhc, rms_norm, sparse_attention, swiglu\n"
            "c = load_train_config(None, 'tiny', ['kernels.mhc=torch'])\n"
            "assert c.kernels == KernelConfig(mhc='torch').validate()\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_apply_kernels_reaches_every_module_and_says_what_runs():
    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny"))
    assert _settings(model) == {op: {"auto"} for op in OPS}
    ran = apply_kernels(model, KernelConfig(mhc="torch", rms_norm="torch"))
    assert ran == dict.fromkeys(ops_of(model.cfg), "torch")  # the CPU runs every twin
    assert _settings(model) == {**{op: {"auto"} for op in OPS}, "mhc": {"torch"}, "rms_norm": {"torch"}}
    ids = torch.randint(0, 97, (1, 21))
    model(ids, labels=ids)
    report = model.impl_report()
    for name in ("kda:torch-chunk", "dsa:torch-sparse", "indexer:torch-chunked", "loss:torch-chunked", "mhc:torch",
                 "norm:torch", "swiglu:torch", "router:torch"):
        assert name in report, report


def test_apply_kernels_refuses_what_cannot_run_before_any_step(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = LongCtxModel(preset("tiny"))
    for op, impl in (("kda", "fla"), ("loss", "liger"), ("sparse_attention", "triton"), ("router", "bf16x3")):
        with pytest.raises(ConfigError, match=rf"kernels.{op} = '{impl}' cannot run here .*CUDA.*set kernels.{op} to "
                                              "'auto' or 'torch'"):
            apply_kernels(model, KernelConfig(**{op: impl}))
    with pytest.raises(ConfigError, match="kernels.mhc must be one of auto, torch, liger"):
        apply_kernels(model, KernelConfig(mhc="triton"))


def test_plain_torch_sets_every_op_and_restores_it():
    """The GPU tests' fp32 references run inside `plain_torch(model)`: every module's every op on its twin,
    the settings restored after, on error too."""
    model = LongCtxModel(preset("tiny"))
    for m in model.modules():  # settings that would run fast paths on CUDA
        for op in getattr(m, "kernels", None) or {}:
            m.kernels[op] = OPS[op].IMPLS[2]
    before = _settings(model)
    with plain_torch(model):
        assert _settings(model) == {op: {"torch"} for op in OPS}
        model(torch.randint(0, 97, (1, 21)))
        assert "mhc:torch" in model.impl_report() and "indexer:torch-chunked" in model.impl_report()
    assert _settings(model) == before
    with pytest.raises(RuntimeError), plain_torch(model):
        raise RuntimeError("restored on error too")
    assert _settings(model) == before


def test_planned_follows_the_device_the_model_and_the_plan():
    """What will run, without running: the twins on the CPU; on a GPU (this process sees none: its
    libraries are assumed installed) every fast path the model's shapes allow; only the ops the model
    has; the memory plan's baseline switches turn auto to the twins of their ops."""
    from longctx.memory.plan import MemoryPlan

    ref = preset("h200-ref")
    assert set(planned(KernelConfig(), "cpu", ref).values()) == {"torch"}
    if not torch.cuda.is_available():
        on_gpu = planned(KernelConfig(), "cuda", ref)
        assert on_gpu == {op: OPS[op].IMPLS[2] for op in OPS}, on_gpu
        assert planned(KernelConfig(mhc="torch"), "cuda", ref)["mhc"] == "torch"
        base = planned(KernelConfig(), "cuda", ref, plan=MemoryPlan.baseline())
        assert [op for op, v in base.items() if v == "torch"] == ["indexer", "loss", "mhc"], base
        # shapes fla's chunk kernel does not take: auto plans the twin (and says why when it runs)
        assert planned(KernelConfig(), "cuda", ref.replace(kda_chunk_size=16))["kda"] == "torch"
        with pytest.raises(ConfigError, match="kernels.kda = 'fla' cannot run here .*kda_chunk_size 32 or 64"):
            planned(KernelConfig(kda="fla"), "cuda", ref.replace(kda_chunk_size=16))
        assert planned(KernelConfig(), "cuda", ref.replace(hc_streams=3))["mhc"] == "torch"
    plain = ref.replace(residual="plain", layer_pattern="K")
    assert ops_of(plain) == ["kda", "kda_conv", "kda_norm", "loss", "rms_norm", "swiglu", "router"]
    assert "router" not in ops_of(plain.replace(mlp_pattern="d"))
    assert list(planned(KernelConfig(), "cpu", plain)) == ops_of(plain)
    import types

    shared = types.SimpleNamespace(layer_kinds=lambda: "KDKD", indexer_kinds=lambda: "ssss", residual="mhc",
                                   mlp_kinds=lambda: "dddd")
    assert "indexer" not in ops_of(shared) and "sparse_attention" in ops_of(shared)  # the D layers' share
