"""The host-buffer logic on the CPU (CUDA's register / unregister calls stood in for): exact sizes, each
registered buffer unregistered exactly once (by `release` or when collected), and a refused registration
said out loud. The GPU half: tests/memory/test_host_buffers_gpu.py."""

from __future__ import annotations

import gc
import warnings

import torch

from longctx.memory import host_buffers as hb


def _stand_ins(monkeypatch, err=0):
    calls = {"register": [], "unregister": []}
    monkeypatch.setattr(hb, "_register", lambda ptr, n: calls["register"].append((ptr, n)) or err)
    monkeypatch.setattr(hb, "_unregister", lambda ptr: calls["unregister"].append(ptr))
    return calls


def test_registered_buffer_is_exact_and_unregistered_once(monkeypatch):
    calls = _stand_ins(monkeypatch)
    n = 3 * 4096 + 12
    raw = hb.page_locked_empty(n)
    assert raw.numel() == n and raw.dtype == torch.uint8
    # whole pages of its own, page-aligned, so that no other buffer's registration shares one
    assert calls["register"] == [(raw.data_ptr(), 4 * 4096)] and raw.data_ptr() % 4096 == 0
    ptr = raw.data_ptr()
    hb.release(raw)
    hb.release(raw)
    assert calls["unregister"] == [ptr]
    del raw
    gc.collect()
    assert calls["unregister"] == [ptr]  # not a second time when collected
    other = hb.page_locked_empty(64)
    optr = other.data_ptr()
    del other
    gc.collect()
    assert calls["unregister"] == [ptr, optr]  # a buffer dropped without release is unregistered too


def test_views_and_pageable_buffers():
    raw = hb.host_buffer(4 * 6 * 2, pinned=False)
    v = hb.as_view(raw, (4, 6), torch.bfloat16)
    assert v.shape == (4, 6) and v.data_ptr() == raw.data_ptr()
    if not torch.cuda.is_available():  # pinned asked for, no CUDA: a pageable buffer of the exact size
        assert hb.host_buffer(100, pinned=True).numel() == 100


def test_a_refused_registration_warns_once_and_falls_back(monkeypatch):
    _stand_ins(monkeypatch, err=2)
    monkeypatch.setattr(hb, "_warned", False)
    real_empty = torch.empty
    pinned = []
    monkeypatch.setattr(hb.torch, "empty", lambda *a, pin_memory=False, **k: pinned.append(pin_memory) or real_empty(*a, **k))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a, b = hb.page_locked_empty(128), hb.page_locked_empty(256)
    assert [str(x.message).split(" (")[0] for x in w] == ["cudaHostRegister failed"]
    assert "power of two" in str(w[0].message) and "memory.pin_memory=false" in str(w[0].message)
    assert pinned == [True, True] and a.numel() == 128 and b.numel() == 256
