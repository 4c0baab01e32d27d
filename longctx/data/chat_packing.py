"""Packing conversations into training rows that keep them apart.

A row of seq_len positions holds whole conversations one after another (never one cut in two), and
pads the rest. Each conversation is its own document: `ChatBatch.cu_seqlens()` gives the
boundaries that KDA (state reset) and DSA (indexer run per document) take, so a packed
conversation computes exactly what it computes alone (tests/train/test_sft.py). Labels are the
template's (-100 on prompts, tool output and padding), shifted inside each conversation, so the
loss paths (chunked, fused, the CP loss share) need nothing new.

The stream reads conversations by index from a source (`source.get(k, limit)`: the k-th
conversation, at most `limit` tokens long) and packs them greedily in that order; its whole state is
the index of the next conversation, so a checkpoint restores it exactly and a curriculum stage that
changes seq_len simply continues. `ConversationList` is the source for conversations from files
(a fresh shuffle each epoch); the embedded task's examples come from `retrieval_task.TrainExamples`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..errors import DataError
from .chat import EncodedChat


class ChatBatch(NamedTuple):
    inputs: torch.Tensor   # int64 [batch, seq_len]
    labels: torch.Tensor   # int64 [batch, seq_len]; -100 = no loss here
    doc_ids: torch.Tensor  # int32 [batch, seq_len]: which conversation of the row (padding is one of its own)

    def cu_seqlens(self) -> torch.Tensor:
        """Document boundaries of the flattened inputs [batch * seq_len] as int64 offsets [n + 1]; every
        row starts a document too (`Batch.cu_seqlens`'s convention)."""
        ids = self.doc_ids
        b, t = ids.shape
        starts = torch.ones(b, t, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        idx = torch.nonzero(starts.reshape(-1)).squeeze(1)
        return torch.cat([idx, torch.tensor([b * t])]).to(torch.int64)


def pack_rows(convs: Sequence[EncodedChat], seq_len: int, pad_id: int = 0) -> ChatBatch:
    """Conversations laid into as few rows as the order allows (a new row when the next one does not
    fit), as the stream packs them; for tests and evaluation."""
    rows, cur, used = [], [], 0
    for c in convs:
        if len(c) > seq_len:
            raise DataError(f"a conversation of {len(c)} tokens does not fit a row of {seq_len}; use longer rows.")
        if used + len(c) > seq_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append(c)
        used += len(c)
    if cur:
        rows.append(cur)
    laid = [_lay(r, seq_len, pad_id) for r in rows]
    return ChatBatch(*(torch.from_numpy(np.stack([x[i] for x in laid])) for i in range(3)))


def _lay(convs: Sequence[EncodedChat], seq_len: int, pad_id: int):
    toks = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, -100, dtype=np.int64)
    ids = np.zeros(seq_len, dtype=np.int32)
    pos = 0
    for d, c in enumerate(convs):
        n = len(c)
        toks[pos:pos + n], labels[pos:pos + n], ids[pos:pos + n] = c.tokens, c.labels, d
        pos += n
    ids[pos:] = len(convs)
    return toks, labels, ids


class ConversationList:
    """Encoded conversations as a stream source: index k is conversation order_e[k mod n] of epoch
    e = k // n, each epoch's order a permutation drawn from (seed, epoch)."""

    def __init__(self, convs: Sequence[EncodedChat], seed: int, names: Sequence[str] | None = None):
        if not convs:
            raise DataError("data.path gave no conversations to train on; point it at a .jsonl or .parquet file of them.")
        self.convs, self.seed = list(convs), int(seed)
        self.names = list(names) if names is not None else [f"conversation {i}" for i in range(len(convs))]
        self._orders: dict[int, np.ndarray] = {}

    def check_fits(self, seq_len: int, setting: str) -> None:
        """One sentence for the first conversation longer than a row of `setting` (a stage's seq_len)."""
        for name, c in zip(self.names, self.convs):
            if len(c) > seq_len:
                raise DataError(f"{name} has {len(c)} tokens, more than {setting} = {seq_len}; raise {setting}, or "
                                "shorten or drop that conversation (conversations are never cut).")

    def get(self, k: int, limit: int) -> EncodedChat:
        n = len(self.convs)
        e = k // n
        if e not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            self._orders[e] = np.random.default_rng([self.seed, e]).permutation(n)
        return self.convs[int(self._orders[e][k % n])]

    def state_key(self) -> tuple:
        return ("conversations", len(self.convs), int(sum(len(c) for c in self.convs)))


class ChatStream:
    """Endless ChatBatches of packed conversations; deterministic and resumable (see the module docstring)."""

    def __init__(self, source, seq_len: int, batch_size: int = 1, pad_id: int = 0):
        self.source, self.pad_id = source, int(pad_id)
        self.cursor = 0
        self._peek: tuple[int, int, EncodedChat] | None = None  # (index, limit, conversation) of the one that did not fit
        self.set_window(seq_len, batch_size)

    def set_window(self, seq_len: int, batch_size: int | None = None) -> None:
        if seq_len < 2 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"seq_len must be >= 2 and batch_size >= 1 (got {seq_len}, {batch_size})")
        self.seq_len = int(seq_len)
        if batch_size is not None:
            self.batch_size = int(batch_size)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "source": list(self.source.state_key()), "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if "source" not in state or tuple(_tuples(state["source"])) != tuple(_tuples(self.source.state_key())):
            raise DataError("the checkpoint's data stream was built from other conversations (or the pretraining "
                            "corpus); resume with the same task, data.path, data.tokenizer and sft settings.")
        self.cursor, self._peek = int(state["cursor"]), None

    def __iter__(self):
        return self

    def __next__(self) -> ChatBatch:
        return self.next_batch()

    def _get(self, k: int) -> EncodedChat:
        if self._peek is not None and self._peek[:2] == (k, self.seq_len):
            return self._peek[2]
        return self.source.get(k, self.seq_len)

    def next_row(self):
        convs = []
        used = 0
        while True:
            c = self._get(self.cursor)
            if len(c) > self.seq_len:
                raise DataError(f"conversation {self.cursor} of the stream has {len(c)} tokens, more than the stage's "
                                f"seq_len = {self.seq_len}; raise the stage's seq_len or shorten that conversation.")
            if used + len(c) > self.seq_len:
                self._peek = (self.cursor, self.seq_len, c)
                break
            convs.append(c)
            used += len(c)
            self.cursor += 1
            if used == self.seq_len:
                break
        return _lay(convs, self.seq_len, self.pad_id)

    def next_batch(self) -> ChatBatch:
        rows = [self.next_row() for _ in range(self.batch_size)]
        return ChatBatch(*(torch.from_numpy(np.stack([r[i] for r in rows])) for i in range(3)))


def _tuples(x):
    """A state key as read back from JSON (lists for tuples), comparable with the live one."""
    return [tuple(_tuples(v)) if isinstance(v, (list, tuple)) else v for v in x]
