"""The chunked liger mHC stream ops against liger's own Functions, under the Triton interpreter on the
CPU (tests/mhc_chunk_check.py; the same check runs on CUDA in tests/ops/test_mhc_gpu.py). Skipped where
liger-kernel is not installed (the CPU CI installs neither liger nor fla)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("liger_kernel")

from mhc_chunk_check import NAMES, assert_matches  # noqa: E402
from triton_interpreter import run_interpreted  # noqa: E402


def test_chunked_stream_ops_equal_liger_functions_under_the_interpreter():
    got = run_interpreted("tests/mhc_chunk_check.py", timeout=600)
    assert len(got) == 4 * len(NAMES)
    # the interpreter's fp32 -> bf16 store truncates where the GPU's rounds to nearest (assert_matches)
    assert_matches([(r["chunk"], r["what"], r["exact"], r["rel"], r["ulps"]) for r in got.values()], bf16_ulps=1)
