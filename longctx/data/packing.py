"""Packing documents into fixed-length training windows, resumably; held-out eval windows.

The stream is the concatenation of all documents (each followed by an optional separator token),
re-shuffled every epoch from (seed, epoch), cut into windows of seq_len + 1 tokens that advance by
seq_len, so every token is a target exactly once. Its whole state is two integers (epoch, cursor
into that epoch's token stream): a checkpoint restores it exactly, and a curriculum stage that
changes seq_len keeps the cursor, so document order simply continues.

Each window also carries per-token document ids (0, 1, ... within the row), from which
`Batch.cu_seqlens()` gives the varlen boundaries a KDA layer needs to reset its state at document
starts.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..errors import DataError


class Batch(NamedTuple):
    tokens: torch.Tensor   # int64 [batch, seq_len + 1]
    doc_ids: torch.Tensor  # int32 [batch, seq_len + 1]: index of the document each token belongs to

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def labels(self) -> torch.Tensor:
        return self.tokens[:, 1:]

    def cu_seqlens(self) -> torch.Tensor:
        """Document boundaries of the flattened inputs [batch * seq_len], as int64 offsets [n + 1]
        (the varlen convention of fla / flash-attn; each row also starts a segment)."""
        ids = self.doc_ids[:, :-1]
        b, t = ids.shape
        starts = torch.ones(b, t, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        idx = torch.nonzero(starts.reshape(-1)).squeeze(1)
        return torch.cat([idx, torch.tensor([b * t])]).to(torch.int64)


class PackedStream:
    """Endless batches of packed windows from tokenised documents; deterministic and resumable."""

    def __init__(self, docs_tokens: Sequence, seq_len: int, seed: int, eos_id: int | None = None, batch_size: int = 1):
        self.docs = [np.asarray(d) for d in docs_tokens if len(d) > 0]
        if not self.docs:
            raise DataError("data.path gave no tokens to train on (every document is empty); point it at text.")
        self.eos_id = eos_id
        self.seed = int(seed)
        self._lens = np.array([len(d) + (eos_id is not None) for d in self.docs], dtype=np.int64)
        self.epoch_len = int(self._lens.sum())
        self.epoch, self.cursor = 0, 0
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.set_window(seq_len, batch_size)

    # ---------------------------------------------------------------- configuration
    def set_window(self, seq_len: int, batch_size: int | None = None) -> None:
        """New window shape (a curriculum stage); the cursor, hence the document order, carries on."""
        if seq_len < 1 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"seq_len and batch_size must be >= 1 (got {seq_len}, {batch_size})")
        self.seq_len = int(seq_len)
        if batch_size is not None:
            self.batch_size = int(batch_size)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "n_docs": len(self.docs), "n_tokens": self.epoch_len}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`. Its seed wins (the shuffle must match); the window shape stays this
        object's own (a resumed run may be in a later stage); a different corpus is refused."""
        if (state["n_docs"], state["n_tokens"]) != (len(self.docs), self.epoch_len):
            raise DataError(
                f"the checkpoint's data stream was built from a different corpus ({state['n_docs']} documents, "
                f"{state['n_tokens']} tokens; now {len(self.docs)}, {self.epoch_len}); resume with the same "
                "data.path, data.tokenizer and data.separator."
            )
        self.seed, self.epoch, self.cursor = int(state["seed"]), int(state["epoch"]), int(state["cursor"])
        self._orders.clear()

    # ---------------------------------------------------------------- iteration
    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def next_batch(self) -> Batch:
        rows = [self.next_row() for _ in range(self.batch_size)]
        return Batch(torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows])))

    def next_row(self) -> tuple[np.ndarray, np.ndarray]:
        """One window (tokens int64 [seq_len + 1], doc ids int32) and advance by seq_len."""
        row = self._take(self.epoch, self.cursor, self.seq_len + 1)
        c = self.cursor + self.seq_len
        self.epoch += c // self.epoch_len
        self.cursor = c % self.epoch_len
        return row

    # ---------------------------------------------------------------- internals
    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
            starts = np.zeros(len(self.docs) + 1, dtype=np.int64)
            np.cumsum(self._lens[perm], out=starts[1:])
            self._orders[epoch] = (perm, starts)
        return self._orders[epoch]

    def _take(self, epoch: int, cursor: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        toks = np.empty(n, dtype=np.int64)
        ids = np.empty(n, dtype=np.int32)
        pos, doc_id = 0, 0
        while pos < n:
            perm, starts = self._order(epoch)
            k = int(np.searchsorted(starts, cursor, side="right")) - 1
            while pos < n and k < len(perm):
                doc = self.docs[perm[k]]
                off = cursor - int(starts[k])
                m = min(len(doc) - off, n - pos)
                if m > 0:
                    toks[pos:pos + m] = doc[off:off + m]
                    ids[pos:pos + m] = doc_id
                    pos, cursor = pos + m, cursor + m
                if pos < n and self.eos_id is not None and cursor - int(starts[k]) == len(doc):
                    toks[pos], ids[pos] = self.eos_id, doc_id
                    pos, cursor = pos + 1, cursor + 1
                if cursor == int(starts[k + 1]):
                    k, doc_id = k + 1, doc_id + 1
            if k == len(perm):
                epoch, cursor = epoch + 1, 0
        return toks, ids


class MixedStream:
    """Rows drawn from several packed streams with fixed weights (a stage's data mixture).

    Row r's source is drawn from rng(seed, r), so the choice depends only on the row counter: the
    mixture is deterministic and resumes exactly with the sub-streams' own state.
    """

    def __init__(self, streams: Sequence[tuple[PackedStream, float]], seed: int, batch_size: int | None = None):
        if not streams:
            raise ValueError("MixedStream needs at least one (stream, weight) pair")
        self.streams = [s for s, _ in streams]
        w = np.array([float(x) for _, x in streams], dtype=np.float64)
        if not all(math.isfinite(x) and x >= 0 for x in w) or w.sum() <= 0:
            raise ValueError(f"mixture weights must be finite, >= 0 and not all zero (got {w.tolist()})")
        self.probs = w / w.sum()
        self.seed = int(seed)
        self.rows = 0
        self.set_window(self.streams[0].seq_len, batch_size or self.streams[0].batch_size)

    def set_weights(self, weights: Sequence[float]) -> None:
        """A new mixture (a curriculum stage); the row counter and the sub-streams carry on."""
        w = np.array([float(x) for x in weights], dtype=np.float64)
        if len(w) != len(self.streams) or not all(math.isfinite(x) and x >= 0 for x in w) or w.sum() <= 0:
            raise ValueError(f"mixture weights must be {len(self.streams)} finite numbers >= 0, not all zero (got {w.tolist()})")
        self.probs = w / w.sum()

    def set_window(self, seq_len: int, batch_size: int | None = None) -> None:
        for s in self.streams:
            s.set_window(seq_len)
        self.seq_len = seq_len
        if batch_size is not None:
            self.batch_size = batch_size

    def state_dict(self) -> dict:
        return {"rows": self.rows, "seed": self.seed, "streams": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["streams"]) != len(self.streams):
            raise DataError(
                f"the checkpoint's data mixture has {len(state['streams'])} sources, this run has {len(self.streams)}; "
                "resume with the same stages.N.data_mix sources."
            )
        self.rows, self.seed = int(state["rows"]), int(state["seed"])
        for s, st in zip(self.streams, state["streams"]):
            s.load_state_dict(st)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def next_batch(self) -> Batch:
        rows = []
        for _ in range(self.batch_size):
            src = int(np.random.default_rng([self.seed, self.rows]).choice(len(self.streams), p=self.probs))
            self.rows += 1
            rows.append(self.streams[src].next_row())
        return Batch(torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows])))


class EvalWindows(NamedTuple):
    tokens: torch.Tensor  # int64 [n, seq_len + 1]
    doc_index: list[int]  # which document each window came from
    offset: list[int]     # where in that document it starts (0 = the document's start)


def eval_windows(docs_tokens: Sequence, seq_len: int, max_windows: int, starts_only: bool = True) -> EvalWindows:
    """Held-out windows of seq_len + 1 tokens, deterministic, taken from document starts.

    Starting at a document's start means position p of the window has exactly p tokens of
    same-document context, so a per-position loss curve measures the use of long context. Documents
    shorter than the window are skipped. With `starts_only=False` and too few documents, further
    non-overlapping windows (offsets seq_len+1, 2(seq_len+1), ...) fill up to `max_windows`.
    """
    n = seq_len + 1
    picked: list[tuple[int, int]] = []
    rnd = 0
    while len(picked) < max_windows:
        added = False
        for i, d in enumerate(docs_tokens):
            off = rnd * n
            if len(d) >= off + n:
                picked.append((i, off))
                added = True
                if len(picked) == max_windows:
                    break
        if not added or starts_only:
            break
        rnd += 1
    if not picked and max_windows > 0:
        longest = max((len(d) for d in docs_tokens), default=0)
        raise DataError(
            f"none of the {len(docs_tokens)} held-out documents has the {n} tokens an eval window needs "
            f"(longest: {longest}); use longer documents, raise data.eval_docs, or lower the stage's seq_len."
        )
    toks = np.stack([np.asarray(docs_tokens[i][o:o + n], dtype=np.int64) for i, o in picked]) if picked else np.zeros((0, n), np.int64)
    return EvalWindows(torch.from_numpy(toks), [i for i, _ in picked], [o for _, o in picked])
