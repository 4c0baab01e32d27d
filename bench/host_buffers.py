"""Host buffers for offload and the chunked step's selections: torch's pinned allocator against buffers
page-locked at their exact size (longctx/memory/host_buffers.py) and pageable ones.

    python bench/host_buffers.py --out DIR [--sizes 1.002,3.0]

For each size (GiB; the defaults: a 128k chunk's selection of h200-ref, 1.002 GiB, and a 256k block input,
3 GiB) and each kind: the host memory it takes (RSS growth of this process), the time to allocate and
page-lock it, and the copy rates GPU -> host and back (medians of 5, CUDA events, non_blocking where the
kind allows). Writes DIR/host_buffers.json. Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import env_record, timed, write_results  # noqa: E402

from longctx.memory.host_buffers import host_rss_bytes, page_locked_empty, release  # noqa: E402

GIB = 2**30


def _alloc(kind: str, n: int) -> torch.Tensor:
    if kind == "torch_pinned":
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
    if kind == "registered":
        return page_locked_empty(n)
    buf = torch.empty(n, dtype=torch.uint8)
    buf.fill_(0)  # commit the pages, as the other two kinds do
    return buf


def _rate(fn, n: int) -> float:
    """GB/s of a copy of n bytes: the median of 5 after one warm-up (CUDA events around the call, so a
    synchronous copy is timed whole too)."""
    return n / (timed(fn, warmup=1, reps=5) / 1e3) / 1e9


def measure(n: int) -> dict:
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 256)
    out = {"bytes": n}
    for kind in ("torch_pinned", "registered", "pageable"):
        torch.cuda.synchronize()
        r0, t0 = host_rss_bytes(), time.perf_counter()
        buf = _alloc(kind, n)
        alloc_s, host = time.perf_counter() - t0, host_rss_bytes() - r0
        nb = kind != "pageable"
        d2h = _rate(lambda: buf.copy_(x, non_blocking=nb), n)
        h2d = _rate(lambda: x.copy_(buf, non_blocking=nb), n)
        out[kind] = {"host_gib": host / GIB, "host_over_size": host / n, "alloc_s": alloc_s, "pinned": buf.is_pinned(),
                     "d2h_gb_s": d2h, "h2d_gb_s": h2d}
        print(f"{n / GIB:.3f} GiB {kind:>12}: host {host / GIB:6.3f} GiB ({host / n:.2f}x), alloc {alloc_s:6.3f} s, "
              f"d2h {d2h:5.1f} GB/s, h2d {h2d:5.1f} GB/s", flush=True)
        if kind == "registered":
            release(buf)
        del buf
        torch.cuda.synchronize()
        torch._C._host_emptyCache()
    del x
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1.002,3.0", help="comma-separated GiB")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/host_buffers.py measures copies to and from a GPU; run it where CUDA is available.",
              file=sys.stderr)
        return 2
    res = {**env_record(), "note": "host_gib: RSS growth of the process on allocating (and page-locking) the buffer",
           "cases": [measure(int(float(s) * GIB) // 4096 * 4096) for s in args.sizes.split(",")]}
    write_results(args.out, "host_buffers.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
