"""The torchrun way in: `torchrun --standalone --nproc-per-node 2` gives init_distributed its
environment, build_mesh its world, and a KDA layer under CP its group."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import launch


def test_torchrun_two_processes():
    if not launch.gloo_available():
        import pytest

        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CP": "2"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(here)), env.get("PYTHONPATH", "")])
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(here, "torchrun_entry.py")], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = re.findall(r"rank (\d) of 2 backend gloo mesh \(1, 2\) device cpu worst ([0-9.]+e[-+][0-9]+|[0-9.]+)", proc.stdout)  # the ranks share one pipe: lines can run together
    assert sorted(int(r) for r, _ in lines) == [0, 1], proc.stdout + proc.stderr
    assert all(float(e) <= 1e-5 for _, e in lines), lines
