"""dev/compile_sm90.py builds every kernel it lists for sm_90 on the CPU (triton's bundled ptxas): it
reads the kernels' signatures, so a kernel whose arguments change breaks it unless this test catches it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def test_compile_sm90_builds_every_kernel(capsys):
    pytest.importorskip("triton")
    path = Path(__file__).resolve().parents[1] / "dev" / "compile_sm90.py"
    spec = importlib.util.spec_from_file_location("compile_sm90", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main() == 0
    out = capsys.readouterr().out
    for name in ("indexer score", "indexer compact", "sparse bwd"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert " registers " in line and "PTX instructions" in line, line
