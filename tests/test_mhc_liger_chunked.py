"""The chunked liger mHC stream ops against liger's own Functions, under the Triton interpreter on the
CPU (tests/mhc_chunk_check.py; the same check runs on CUDA in tests/test_gpu_mhc.py). Skipped where
liger-kernel is not installed (the CPU CI installs neither liger nor fla)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("liger_kernel")

ROOT = Path(__file__).resolve().parents[1]


def test_chunked_stream_ops_equal_liger_functions_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "mhc_chunk_check.py"), "cpu"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ROW") == 4 * 7
