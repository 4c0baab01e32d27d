"""PNG figures of a run: the loss curve and per-position loss before vs after (matplotlib, Agg)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def loss_curve(records: list[dict], path: str):
    steps = [r["step"] for r in records if "loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in records if "loss" in r], lw=1, label="train loss")
    stage_starts = {}
    for r in records:
        if "loss" in r:
            stage_starts.setdefault(r["stage"], (r["step"], r["seq_len"]))
    for st, (s, L) in stage_starts.items():
        ax.axvline(s, color="gray", ls=":", lw=0.8)
        ax.text(s, ax.get_ylim()[1], f" stage {st}: {L} tok", va="top", fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def per_position(before: dict, after: dict, path: str):
    mids = [(b["start"] + b["end"]) / 2 for b in before["buckets"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(mids, [b["loss"] for b in before["buckets"]], "o-", label=f"before ({before['loss']:.3f})")
    ax.plot(mids, [b["loss"] for b in after["buckets"]], "o-", label=f"after ({after['loss']:.3f})")
    ax.set_xlabel("position in held-out window (bucket centre)")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
