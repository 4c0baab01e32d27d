"""dev/compile_sm90.py builds every kernel it lists for sm_90 on the CPU (triton's bundled ptxas): it
reads the kernels' signatures, so a kernel whose arguments change breaks it unless this test catches it.

It runs in a subprocess without TRITON_INTERPRET: other CPU tests import the kernels under the
interpreter, and a kernel imported that way cannot be compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_compile_sm90_builds_every_kernel():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(root / "dev" / "compile_sm90.py")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name in ("indexer score", "indexer compact", "sparse bwd"):
        line = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        assert " registers " in line and "PTX instructions" in line, line
    # built as a launch specializes it (aligned pointers, strides that are multiples of 16), the
    # backward's dKV atomics are 16-byte vectors; scalar ones mean the build lost that specialization
    lines = proc.stdout.splitlines()
    ops = lines[next(i for i, line in enumerate(lines) if line.startswith("sparse bwd")) + 1]
    assert "add.v4.f32" in ops and "add.f32'" not in ops, ops
