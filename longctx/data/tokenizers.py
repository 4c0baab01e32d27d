"""Tokenizers: byte-level (needs nothing) or a local HF `tokenizer.json` (needs `tokenizers`).

Nothing is fetched from a hub: `load_tokenizer` takes "byte" or a path on disk. Token ids come back
as numpy arrays (uint8 for bytes, int32 otherwise) so a corpus of millions of tokens stays compact
until the packer turns windows into int64 tensors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import DataError

# Special tokens that commonly mark the end of a document, most specific first.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255.

    `eos_id` is 0 (the NUL byte): folders and files that contain NUL are rejected as binary, so in
    text corpora NUL is free to serve as the document separator without growing the vocabulary.
    """

    vocab_size = 256
    eos_id = 0
    name = "byte"

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text if isinstance(text, (bytes, bytearray)) else text.encode("utf-8")
        return np.frombuffer(bytes(data), dtype=np.uint8).copy()

    def decode(self, ids) -> str:
        arr = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokenizer ids must be in [0, 255] (got min {arr.min()}, max {arr.max()})")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """A local `tokenizer.json` through the `tokenizers` package (the fast Rust BPE/Unigram)."""

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # optional dependency (the `data` extra)
            raise DataError(
                f"data.tokenizer '{path}' needs the `tokenizers` package; install it with "
                "`pip install tokenizers` (or `pip install longctx[data]`), or set data.tokenizer=byte."
            ) from e
        self.path = str(path)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            raise DataError(
                f"data.tokenizer '{path}' is not a readable tokenizer.json ({_first_line(e)}); "
                "point it at a tokenizer.json saved by the `tokenizers` library or set data.tokenizer=byte."
            ) from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for t in _EOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None)
        self.name = self.path
        self._dtype = np.int32 if self.vocab_size < 2**31 else np.int64

    def encode(self, text: str | bytes) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        strs = [t.decode("utf-8", errors="replace") if isinstance(t, (bytes, bytearray)) else t for t in texts]
        encs = self._tok.encode_batch(strs, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self._dtype) for e in encs]

    def decode(self, ids) -> str:
        arr = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids).reshape(-1)
        return self._tok.decode([int(i) for i in arr], skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"`, a path to a `tokenizer.json`, or a folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    p = Path(spec).expanduser()
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(
            f"data.tokenizer '{spec}' does not exist; set it to \"byte\" or to the path of a local tokenizer.json "
            "(nothing is downloaded)."
        )
    return HFTokenizer(p)


def separator_id(tokenizer: Tokenizer, enabled: bool = True) -> int | None:
    """The id to put between packed documents (data.separator), or None when it is off."""
    if not enabled:
        return None
    if tokenizer.eos_id is None:
        raise DataError(
            f"data.separator is on but data.tokenizer '{tokenizer.name}' has no end-of-text token "
            f"(looked for {', '.join(_EOS_CANDIDATES)}); set data.separator=false or use a tokenizer that has one."
        )
    return tokenizer.eos_id


def tokenize_documents(docs, tokenizer: Tokenizer, quiet: bool = False, desc: str = "tokenizing",
                       batch_docs: int = 64) -> list[np.ndarray]:
    """Encode each document's text; a tqdm bar shows progress on a terminal unless `quiet`.

    `docs` holds `Document`s or plain str/bytes. Documents are sent to the tokenizer in groups so
    the Rust tokenizer can use its thread pool.
    """
    from tqdm.auto import tqdm

    texts = [getattr(d, "text", d) for d in docs]
    total = sum(len(t) for t in texts)
    out: list[np.ndarray] = []
    disable = quiet or not sys.stderr.isatty()
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=disable, leave=False) as bar:
        for i in range(0, len(texts), batch_docs):
            group = texts[i:i + batch_docs]
            out.extend(tokenizer.encode_batch(group))
            bar.update(sum(len(t) for t in group))
    return out


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__
