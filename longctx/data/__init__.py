"""Data: documents from files, folders, jsonl/parquet, FASTA or the embedded stdlib corpus;
byte or local HF tokenizers; resumable packing into training windows and held-out eval windows.

The names below load their module on first use, so that the torch-free parts (the sources, the
tokenizers, the embedded task's question kinds, which `longctx.config` validates `sft.kinds` against)
import without torch."""

from __future__ import annotations

import importlib

_WHERE = {
    "Batch": "packing", "EvalWindows": "packing", "MixedStream": "packing", "PackedStream": "packing",
    "eval_windows": "packing",
    "Document": "sources", "load_documents": "sources", "load_split": "sources", "read_fasta": "sources",
    "read_records": "sources", "split_documents": "sources", "stable_hash": "sources", "stdlib_corpus": "sources",
    "ByteTokenizer": "tokenizers", "HFTokenizer": "tokenizers", "load_tokenizer": "tokenizers",
    "separator_id": "tokenizers", "tokenize_documents": "tokenizers",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
