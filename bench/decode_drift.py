"""CPU: how far the decode path drifts from the training forward under bf16 autocast, with MoE routing
free and with routing recorded in the training forward and replayed (`longctx.measure.decode_drift`,
which tests/test_end_to_end_gpu.py runs at 128k on the GPU; here on a small model), and in fp32 as the
control.

    python bench/decode_drift.py [--layers 4] [--seq 600] [--last 16] [--chunk 256]

h200-ref cut to --layers blocks (the first dense MLP, then MoE), random weights with the test's LM
head (logit std ~3). Prints one line per case; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from longctx.config import preset  # noqa: E402
from longctx.measure.decode_drift import decode_vs_training  # noqa: E402
from longctx.model import LongCtxModel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=600)
    ap.add_argument("--last", type=int, default=16, help="decoded tokens compared")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    a = ap.parse_args()
    cfg = preset("h200-ref").replace(num_layers=a.layers, mlp_pattern="d" + "m" * (a.layers - 1))
    for name, bf16, replay in (("bf16, free routing", True, False), ("bf16, replayed routing", True, True),
                               ("fp32, free routing", False, False)):
        torch.manual_seed(0)
        model = LongCtxModel(cfg).eval()
        torch.nn.init.normal_(model.lm_head.weight, 0.0, 3.0 / cfg.hidden_size**0.5)
        ids = torch.randint(0, cfg.vocab_size, (1, a.seq))
        t0 = time.perf_counter()
        with torch.no_grad():
            diff, rel, spread, _ = decode_vs_training(model, ids, a.last, a.chunk, replay_routing=replay, bf16=bf16)
        print(f"{name:<24} mean abs log-prob difference {diff:.4f}, hidden rel-RMS {rel:.3e} "
              f"(log-prob std {spread:.2f}; {time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
