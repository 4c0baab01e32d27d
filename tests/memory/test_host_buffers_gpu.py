"""On the GPU: host buffers page-locked at their exact size (longctx/memory/host_buffers.py) are pinned,
cost their size in host memory (torch's pinned allocator: the next power of two), copy asynchronously
and exactly, and carry the offloader's round trip. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from longctx.memory.host_buffers import host_rss_bytes, page_locked_empty, release
from longctx.memory.offload import Offloader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_page_locked_buffer_is_exact_pinned_and_async():
    n = (1 << 30) + (1 << 25) + 4099  # just over 1 GiB, like a 128k chunk's selection: torch would pin 2 GiB
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()  # the CUDA context's own host memory (~0.1 GiB) before the first measurement
    before = host_rss_bytes()
    raw = page_locked_empty(n)
    grew = host_rss_bytes() - before
    assert raw.numel() == n and raw.is_pinned()
    assert grew < 1.05 * n, (grew, n)  # registering commits the pages it locks: about n, not 2^31
    before = host_rss_bytes()
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    print(f"host memory for {n / 2**30:.3f} GiB: registered {grew / 2**30:.3f} GiB, "
          f"torch's pinned allocator {(host_rss_bytes() - before) / 2**30:.3f} GiB")
    del ref
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    torch.cuda.synchronize()
    raw.copy_(x, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    in_flight = not done.query()  # ~20 ms of copy at 55 GB/s: a synchronous (pageable) copy would be over
    torch.cuda.synchronize()
    assert in_flight, "the device-to-host copy into a registered buffer did not run asynchronously"
    y = torch.empty_like(x)
    y.copy_(raw, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(x, y)
    release(raw)
    assert not raw.is_pinned()


def test_offloader_round_trip_through_registered_buffers():
    torch.manual_seed(0)
    w = torch.randn(777, 333, device="cuda", requires_grad=True)
    x = torch.randn(5000, 777, device="cuda", requires_grad=True)

    def f():
        return (torch.tanh(x @ w) * x[:, :333]).pow(2).sum()

    f().backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    off = Offloader(pin_memory=True, min_bytes=0)
    for step in range(2):  # the second step reuses the first one's buffers
        with off.hooks(group=0):
            loss = f()
        assert off.handles and all(h.host.is_pinned() for h in off.handles)
        assert off.kept_bytes == sum(h.nbytes for h in off.handles)  # exact sizes, no power-of-two rounding
        loss.backward()
        torch.testing.assert_close(x.grad, ref[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w.grad, ref[1], rtol=1e-6, atol=1e-6)
        x.grad = w.grad = None
        off.end_step()
    off.close()
    assert off.kept_bytes == 0
