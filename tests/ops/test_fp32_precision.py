"""fp32 means fp32 (issue 21): longctx's Triton kernels take fp32 inputs' dots at full precision, and a library
kernel that cannot says so, naming the op. On the H200 (bench/fp32_parity.py, bench/results/fp32_parity.json)
fla-core's chunk_kda differs from the torch form by 1.1e-3 relative on the same fp32 inputs: its dots keep
tl.dot's default, TF32. Run on the CPU: the launches are caught before they run."""

from __future__ import annotations

import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import longctx
from longctx import errors
from longctx.ops import tf32_allowed, warn_tf32

pytest.importorskip("triton")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """errors.warn_fallback says each message once per process: a test sees its own."""
    monkeypatch.setattr(errors, "_FALLBACKS_SAID", set())


@pytest.fixture
def tf32(monkeypatch):
    """Sets torch.backends.cuda.matmul.allow_tf32 for the test, restored after."""
    kept = torch.backends.cuda.matmul.allow_tf32
    yield lambda on: setattr(torch.backends.cuda.matmul, "allow_tf32", on)
    torch.backends.cuda.matmul.allow_tf32 = kept


def _said(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]


def test_tf32_allowed_follows_torchs_matmul_switch(tf32):
    tf32(False)
    assert not tf32_allowed()
    tf32(True)
    assert tf32_allowed()


def test_warn_tf32_speaks_for_fp32_inputs_once_unless_tf32_is_allowed(tf32, fresh_warnings):
    tf32(False)
    x32, x16 = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    assert _said(lambda: warn_tf32("op A", "fix A", x16)) == []  # 16-bit inputs: TF32 is more than they hold
    said = _said(lambda: (warn_tf32("op A", "fix A", x16, x32), warn_tf32("op A", "fix A", x32)))
    assert len(said) == 1 and said[0].startswith("op A takes fp32 inputs' products in TF32") and "fix A" in said[0]
    tf32(True)
    assert _said(lambda: warn_tf32("op B", "fix B", x32)) == []  # the user let fp32 matmuls take TF32


def test_fla_chunk_kda_says_it_takes_fp32_through_tf32(monkeypatch, tf32, fresh_warnings):
    """The wrapper warns, naming chunk_kda and kernels.kda 'torch', for fp32 q/k/v, and not for bf16 (fla stubbed:
    the warning comes before the kernel runs)."""
    from longctx.ops.kda import fla as fla_backend

    stub = types.ModuleType("fla.ops.kda")
    stub.chunk_kda = lambda q, *a, **kw: (q, None)
    for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")), ("fla.ops.kda", stub)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(fla_backend, "_require", lambda *t: None)
    tf32(False)

    def run(dtype):
        q = torch.zeros(1, 8, 2, 16, dtype=dtype)
        beta = torch.zeros(1, 8, 2, dtype=dtype)
        fla_backend.fla_chunk_kda(q, q, q, q, beta, A_log=torch.zeros(2), dt_bias=torch.zeros(32), lower_bound=-5.0,
                                  scale=0.25)

    assert _said(lambda: run(torch.bfloat16)) == []
    said = _said(lambda: run(torch.float32))
    assert len(said) == 1 and "chunk_kda" in said[0] and "'torch'" in said[0] and "TF32" in said[0], said


def test_every_dot_of_our_kernels_names_its_precision():
    """tl.dot's default for fp32 operands is TF32: each of ours says what it takes (the PREC constexpr of its
    launch, below), so that none inherits the default."""
    calls = []
    for p in Path(longctx.__file__).parent.rglob("*.py"):
        text = p.read_text()
        for m in re.finditer(r"\btl\.dot\(", text):
            depth, i = 1, m.end()
            while depth:  # to the call's closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            calls.append((p.name, text[m.start():i]))
    assert len(calls) >= 10, calls  # the scan sees the kernels
    assert [c for c in calls if "input_precision=" not in c[1]] == []


class _Launched(Exception):
    pass


class _Catch:
    """Stands for a @triton.jit kernel: `kernel[grid](...)` records the launch's PREC and stops there."""

    def __init__(self, seen: list):
        self.seen = seen

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.seen.append(kw["PREC"])
            raise _Launched

        return launch


def _launches() -> list[tuple]:
    """(module, kernel name, call on tensors of a dtype) for every kernel launch of ours with a PREC."""
    from longctx.ops.mhc import triton as mp
    from longctx.ops.indexer import triton as tp
    from longctx.ops.sparse_attention import triton as sk

    def sparse(dt):
        q, kv, idx = torch.randn(1, 4, 2, 16, dtype=dt), torch.randn(1, 4, 16, dtype=dt), torch.zeros(1, 4, 3, dtype=torch.int32)
        return q, kv, idx

    def indexer(dt):
        return torch.randn(1, 8, 2, 16, dtype=dt), torch.randn(1, 8, 2), torch.randn(1, 2, 16, dtype=dt)

    def mhc(dt):
        return torch.randn(5, 64, dtype=dt), torch.randn(64, 24)

    return [
        (sk, "_sparse_attn_fwd", lambda dt: sk.sparse_attention_fwd(*sparse(dt), 0.25)),
        (sk, "_sparse_attn_bwd", lambda dt: sk.sparse_attention_bwd(
            *(s := sparse(dt)), torch.randn_like(s[0]), torch.zeros(1, 4, 2), torch.randn_like(s[0]), 0.25)),
        (tp, "_kpool_score_kernel", lambda dt: tp.kpool_scores_triton(*indexer(dt), 4, 2)),
        (mp, "_project_fwd", lambda dt: mp.project_fwd(*mhc(dt), 1e-6)),
        (mp, "_project_bwd", lambda dt: mp.project_bwd(*(x := mhc(dt)), torch.randn(5, 24), torch.rand(5) + 1,
                                                        torch.randn(5, 24))),
    ]


def test_our_kernels_launch_fp32_inputs_with_ieee_dots(monkeypatch):
    """Each of our Triton launches gives fp32 inputs "ieee" dots (caught before the kernel runs; CPU tensors pass
    the wrappers' device checks as under the interpreter); bf16 inputs keep TF32 on the kernels whose twins
    state it (the sparse attention's and the mHC projection's; the indexer's compares exactly under the
    interpreter, so there it takes "ieee" too)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod, name, call in _launches():
        seen: list = []
        monkeypatch.setattr(mod, name, _Catch(seen))
        for dt in (torch.float32, torch.bfloat16):
            with pytest.raises(_Launched):
                call(dt)
        assert seen[0] == "ieee", (name, seen)
        if "kpool" not in name:
            assert seen[1] == "tf32", (name, seen)
