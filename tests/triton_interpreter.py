"""Run a test module's `__main__` under TRITON_INTERPRET=1 in a fresh process and collect its results.

The interpreter must be switched on before triton is first imported, and other test modules import
it first, so kernel tests run themselves as a script in a subprocess and print `RESULT {json}` lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = sorted({str(p.parent) for p in (ROOT / "tests").rglob("*.py")})  # as conftest.py puts them on sys.path


def run_interpreted(script: str, timeout: int = 300) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), *TEST_DIRS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, script], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["name"]] = r
    return out
