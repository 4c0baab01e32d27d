"""The CUDA caching allocator's settings, chosen before the step's first large allocation.

Why: a long-sequence step allocates blocks of many large sizes (at 256k tokens, 6 GiB requests beside
small ones). The default allocator carves requests out of cached segments and cannot merge the pieces,
so memory that is free in total is not free in one piece: with it, bench/memory.py at 262,144 tokens
(recompute on, no offload, `--cuda-alloc ''`) runs out of memory on the H200 with 114.9 GiB allocated and
18.4 GiB reserved but unallocated. Expandable segments grow one virtual
segment by mapping more physical memory instead (torchtitan's launch script sets the same).

`memory` keeps the setting beside the plan it serves; the environment variable, when set, wins (it is
the user's own choice), and what is in effect goes to the log."""

from __future__ import annotations

import os

import torch

DEFAULT = "expandable_segments:True"
ENV = "PYTORCH_CUDA_ALLOC_CONF"
_SET = [None]  # what configure() put into the environment (a later call may change it; a user's value stays)


def configure(setting: str = DEFAULT) -> str:
    """Apply `setting` (PYTORCH_CUDA_ALLOC_CONF syntax; "" = torch's defaults) unless the environment
    names one. Before CUDA starts it goes into the environment (read when the allocator starts); after,
    into the running allocator, where it applies to segments allocated from then on. Returns what is in
    effect, for the log."""
    env = os.environ.get(ENV)
    if env is not None and env != _SET[0]:
        return f"{env} (from {ENV})"
    if not setting:
        if env is not None:  # ours, from an earlier call
            del os.environ[ENV]
            _SET[0] = None
        return "torch defaults"
    os.environ[ENV] = _SET[0] = setting
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(setting)
    return setting
