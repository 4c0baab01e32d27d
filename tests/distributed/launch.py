"""Run a function in N gloo processes on this machine and collect what each returns.

    results = run(check_fn, 2, arg1, arg2)   # check_fn(rank, world, arg1, arg2) on ranks 0 and 1

Starting processes that import torch costs seconds on a 2-core machine, so the processes of each
world size are started once per test session and kept: `run` hands them one job at a time (the
function travels by reference, so it must live at the top level of an importable module) and
returns the per-rank results in rank order. An exception on any rank fails the call with that
rank's traceback; the processes are then stopped (a failed collective can leave the others
waiting) and the next call starts fresh ones. A job that outlives `timeout` is treated the same.
The process group is gloo over 127.0.0.1 on a free port; every process runs one intra-op thread.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_STOP = "stop"


def gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, jobs, results, collective_timeout_s: float) -> None:
    torch.set_num_threads(1)
    if os.path.exists("/sys/class/net/lo"):  # gloo otherwise picks the interface of the host name, which may not route
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        job = jobs.get()
        if job == _STOP:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except Exception:  # noqa: BLE001
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    """`world` serving processes in one gloo group."""

    def __init__(self, world: int, start_timeout: float = 120.0, collective_timeout_s: float = 60.0):
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.jobs[r], self.results, collective_timeout_s),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self._collect(start_timeout, "starting the process group")

    def _collect(self, timeout: float, what: str) -> list:
        got: dict[int, object] = {}
        while len(got) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise AssertionError(f"{what}: no answer from ranks {sorted(set(range(self.world)) - set(got))} "
                                     f"of {self.world} within {timeout:.0f} s") from None
            if not ok:
                self.close()
                raise AssertionError(f"{what}: rank {rank} of {self.world} failed:\n{value}")
            got[rank] = value
        return [got[r] for r in range(self.world)]

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        for q in self.jobs:
            q.put((fn, args))
        return self._collect(timeout, f"{getattr(fn, '__name__', fn)} in {self.world} processes")

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                try:
                    q.put(_STOP)
                except Exception:  # noqa: BLE001 - a queue already torn down
                    pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        _POOLS.pop(self.world, None)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)


_POOLS: dict[int, Pool] = {}


def pool(world: int) -> Pool:
    """The session's serving processes for `world` (started on first use); skips without gloo."""
    if not gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    p = _POOLS.get(world)
    if p is None or not p.alive:
        p = _POOLS[world] = Pool(world)
    return p


def run(fn, world: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, world, *args) on every rank of a `world`-process gloo group; the results in rank order."""
    return pool(world).run(fn, *args, timeout=timeout)


@atexit.register
def _close_all() -> None:
    for p in list(_POOLS.values()):
        p.close()
