"""Where documents come from: a text file, a folder, jsonl/parquet (HF `datasets`, local only),
FASTA genomes, or the embedded default corpus (the Python standard library's own sources).

A document is one unit of long context: a file, a record, a package. `Document.text` is a str,
or bytes for FASTA sequence text (ASCII nucleotides; the byte tokenizer takes them as they are).
Every user mistake raises `DataError` with one sentence naming `data.path` (or the relevant
setting) and the fix.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import NamedTuple

from ..errors import DataError

FASTA_SUFFIXES = (".fa", ".fasta", ".fna")
RECORD_SUFFIXES = (".jsonl", ".parquet")
_SNIFF = 8192
_KINDS = "point it at a text file, a folder, a .jsonl/.parquet file or a FASTA file"


class Document(NamedTuple):
    name: str
    text: str | bytes


# ------------------------------------------------------------------------------ user data
def load_documents(path: str | os.PathLike, text_field: str = "text", setting: str = "data.path") -> list[Document]:
    """All documents under `path` (a file or a folder), in a deterministic order."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{setting} '{path}' does not exist; {_KINDS}.")
    if p.is_dir():
        docs = _load_folder(p, text_field, setting)
        if not docs:
            raise DataError(f"{setting} '{path}' holds no text files (binary and hidden files are skipped); {_KINDS}.")
        return docs
    docs = _load_file(p, p.name, text_field, setting, strict=True)
    if not docs:
        raise DataError(f"{setting} '{path}' has no documents (it is empty); point it at a file with text in it.")
    return docs


def _load_folder(root: Path, text_field: str, setting: str) -> list[Document]:
    docs: list[Document] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .git, .venv, ...
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            f = Path(dirpath) / fn
            if f.is_file():
                docs.extend(_load_file(f, f.relative_to(root).as_posix(), text_field, setting, strict=False))
    return docs


def _load_file(f: Path, name: str, text_field: str, setting: str, strict: bool) -> list[Document]:
    """The documents in one file; binary files raise when given directly (`strict`), else are skipped."""
    low = f.name.lower()
    if low.endswith(FASTA_SUFFIXES) or low.endswith(tuple(s + ".gz" for s in FASTA_SUFFIXES)):
        return read_fasta(f, name, setting)
    if low.endswith(RECORD_SUFFIXES):
        return read_records(f, name, text_field, setting)
    raw = f.read_bytes()
    if not raw:
        return []
    text = _as_text(raw)
    if text is None:
        if strict:
            raise DataError(
                f"{setting} '{f}' is not a text file (it has NUL bytes or is not UTF-8); {_KINDS}."
            )
        return []
    return [Document(name, text)] if text.strip() else []


def _as_text(raw: bytes) -> str | None:
    if b"\x00" in raw[:_SNIFF]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_records(f: Path, name: str, text_field: str, setting: str = "data.path") -> list[Document]:
    """One document per row of a local .jsonl or .parquet file, via HF `datasets` (no hub access)."""
    try:
        from datasets import load_dataset
        from datasets.utils.logging import disable_progress_bar
    except ImportError as e:
        raise DataError(
            f"{setting} '{f}' needs the `datasets` package to read .jsonl/.parquet; install it with "
            "`pip install datasets` (or `pip install longctx[data]`)."
        ) from e
    if f.stat().st_size == 0:
        return []
    builder = "parquet" if f.name.lower().endswith(".parquet") else "json"
    disable_progress_bar()
    # datasets converts to Arrow in a cache dir; a throwaway one keeps ~/.cache clean (we hold the
    # rows in memory anyway and tokenise them once).
    with tempfile.TemporaryDirectory(prefix="longctx-datasets-") as cache:
        try:
            ds = load_dataset(builder, data_files=str(f), split="train", cache_dir=cache, keep_in_memory=True)
        except Exception as e:  # datasets wraps parse errors in several exception types
            kind = "Parquet" if builder == "parquet" else "JSON lines (one JSON object per line)"
            raise DataError(f"{setting} '{f}' is not valid {kind} ({_short(e)}); fix the file or point {setting} elsewhere.") from e
    if text_field not in ds.column_names:
        cols = ", ".join(ds.column_names) or "none"
        raise DataError(
            f"data.text_field '{text_field}' is not a column of '{f}' (columns: {cols}); set data.text_field to the column that holds the text."
        )
    docs = []
    for i, t in enumerate(ds[text_field]):
        if t is None:
            continue
        if not isinstance(t, str):
            raise DataError(
                f"data.text_field '{text_field}' in '{f}' row {i} is {type(t).__name__}, not text; "
                "set data.text_field to a column of strings."
            )
        if t.strip():
            docs.append(Document(f"{name}:{i}", t))
    return docs


def read_fasta(f: Path, name: str, setting: str = "data.path") -> list[Document]:
    """One document per FASTA record: the sequence lines joined, the '>' header kept only as the name.

    Case is kept (lowercase = soft-masked repeats in genome assemblies, which is information).
    """
    opener = gzip.open if f.name.lower().endswith(".gz") else open
    docs: list[Document] = []
    header, seq = None, []

    def flush():
        if seq:
            rec = header.split()[0] if header and header.split() else str(len(docs))
            docs.append(Document(f"{name}:{rec}", b"".join(seq)))

    try:
        with opener(f, "rb") as fh:
            for line in fh:
                line = line.strip()
                if not line or line.startswith(b";"):
                    continue
                if line.startswith(b">"):
                    flush()
                    header, seq = line[1:].decode("utf-8", errors="replace"), []
                else:
                    seq.append(line)
    except (OSError, EOFError) as e:  # truncated or not-really-gzip files
        raise DataError(f"{setting} '{f}' could not be read as FASTA ({_short(e)}); fix or re-download the file.") from e
    flush()
    if docs and (b"\x00" in docs[0].text[:_SNIFF]):
        raise DataError(f"{setting} '{f}' is not a FASTA text file (it has NUL bytes); {_KINDS}.")
    return docs


# ------------------------------------------------------------------------------ held-out split
def stable_hash(name: str) -> int:
    """A hash of a name that is the same on every machine and Python (unlike `hash`)."""
    return int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big")


def held_out(keys: list[str], n: int) -> set[int]:
    """The indices of the `n` keys with the smallest stable hashes (ties in list order): a held-out set that
    does not depend on the order of the items, only on what their keys say."""
    return set(sorted(range(len(keys)), key=lambda i: (stable_hash(keys[i]), i))[:n])


def split_documents(docs: list[Document], eval_docs: int) -> tuple[list[Document], list[Document]]:
    """Hold out `eval_docs` documents, chosen by a stable hash of their names (not their order).

    With no more documents than `eval_docs` (a single book, say), every document is cut instead:
    its last tenth becomes a held-out document named `NAME#tail`, its first nine tenths train.
    """
    if eval_docs <= 0:
        return list(docs), []
    if len(docs) > eval_docs:
        held = held_out([d.name for d in docs], eval_docs)
        return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]
    train, held = [], []
    for d in docs:
        cut = len(d.text) - max(1, len(d.text) // 10)
        if cut < 1:
            raise DataError(
                f"data.path has only {len(docs)} document(s) and '{d.name}' is too short to split off a held-out "
                "part; add more text or set data.eval_docs=0."
            )
        train.append(Document(d.name, d.text[:cut]))
        held.append(Document(d.name + "#tail", d.text[cut:]))
    return train, held


# ------------------------------------------------------------------------------ embedded corpus
# Always held out (when present), so the demo's eval set holds a mid-size and a large package.
STDLIB_EVAL_ALWAYS = ("email", "json")
STDLIB_EVAL_SHARE = 10  # and 1 in this many of the rest, by stable hash of the name
_TEST_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}


def stdlib_corpus() -> tuple[list[Document], list[Document]]:
    """The Python standard library's sources as a corpus that exists on every machine.

    One package per document, the way a coding agent reads a repository: each top-level package
    directory (one with an `__init__.py`) becomes one document, its .py files concatenated in
    sorted order, each introduced by a `# file: relpath` line. Top-level single-module files
    (argparse.py, typing.py, ...) are kept as one document each: many are long (tens of KB) and
    real. Test suites (`test`, `tests`, `idle_test` dirs, at any depth), `site-packages` and the
    machine-generated `_sysconfigdata*` are left out. Returns (train_docs, eval_docs).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.is_dir():
            if entry.name in _TEST_DIRS or entry.name.startswith(".") or not (entry / "__init__.py").is_file():
                continue
            parts = []
            for dirpath, dirnames, filenames in os.walk(entry):
                dirnames[:] = sorted(d for d in dirnames if d not in _TEST_DIRS and not d.startswith("."))
                for fn in sorted(filenames):
                    if fn.endswith(".py"):
                        f = Path(dirpath) / fn
                        parts.append(f"# file: {f.relative_to(root).as_posix()}\n{_read_source(f)}")
            if parts:
                docs.append(Document(entry.name, "\n".join(parts)))
        elif entry.suffix == ".py" and not entry.name.startswith("_sysconfigdata"):
            docs.append(Document(entry.name, f"# file: {entry.name}\n{_read_source(entry)}"))
    if not docs:
        raise DataError(
            f"the embedded corpus found no Python sources under {root} (this Python ships without them); "
            "set data.path to a text file or folder."
        )
    held = [d for d in docs if d.name in STDLIB_EVAL_ALWAYS or stable_hash(d.name) % STDLIB_EVAL_SHARE == 0]
    if len(held) < 2:  # a stripped-down stdlib: fall back to the two largest documents
        held = sorted(docs, key=lambda d: -len(d.text))[:2]
    names = {d.name for d in held}
    return [d for d in docs if d.name not in names], [d for d in docs if d.name in names]


def _read_source(f: Path) -> str:
    return f.read_bytes().decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ one call for the trainer
def load_split(path: str | None, text_field: str = "text", eval_docs: int = 2) -> tuple[list[Document], list[Document]]:
    """(train_docs, eval_docs) for `data.path`: the embedded corpus when None (its own fixed split)."""
    if path is None:
        return stdlib_corpus()
    return split_documents(load_documents(path, text_field), eval_docs)


def _short(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    s = s[0] if s else type(e).__name__
    return s if len(s) < 200 else s[:197] + "..."
