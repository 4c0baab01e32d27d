"""Test-wide settings. CI reruns must be reproducible: hypothesis draws the same examples each run
(set HYPOTHESIS_PROFILE=explore locally to search fresh ones)."""

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Tests mirror the package (tests/ops, tests/memory, ...); a CPU test may reuse a GPU test's comparison or a
# shared helper (hf_reference, triton_interpreter), so every test folder is importable by module name.
_TESTS = Path(__file__).resolve().parent
for _d in sorted({p.parent for p in _TESTS.rglob("*.py")}):
    if str(_d) not in sys.path:
        sys.path.append(str(_d))

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and immune to a busy machine's thread contention.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
