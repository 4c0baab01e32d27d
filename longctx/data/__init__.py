"""Data: documents from files, folders, jsonl/parquet, FASTA or the embedded stdlib corpus;
byte or local HF tokenizers; resumable packing into training windows and held-out eval windows."""

from .packing import Batch, EvalWindows, MixedStream, PackedStream, eval_windows
from .sources import (
    Document,
    load_documents,
    load_split,
    read_fasta,
    read_records,
    split_documents,
    stable_hash,
    stdlib_corpus,
)
from .tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer, separator_id, tokenize_documents

__all__ = [
    "Batch", "ByteTokenizer", "Document", "EvalWindows", "HFTokenizer", "MixedStream", "PackedStream",
    "eval_windows", "load_documents", "load_split", "load_tokenizer", "read_fasta", "read_records",
    "separator_id", "split_documents", "stable_hash", "stdlib_corpus", "tokenize_documents",
]
