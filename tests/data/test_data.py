"""Data pipeline: sources, tokenizers, packing (resumable), mixtures and eval windows."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from longctx.data import (
    ByteTokenizer,
    Document,
    MixedStream,
    PackedStream,
    eval_windows,
    load_documents,
    load_split,
    load_tokenizer,
    separator_id,
    split_documents,
    stdlib_corpus,
    tokenize_documents,
)
from longctx.errors import DataError


# ------------------------------------------------------------------------------ embedded corpus
def test_stdlib_corpus_nonempty_deterministic_disjoint():
    train, held = stdlib_corpus()
    train2, held2 = stdlib_corpus()
    assert train == train2 and held == held2
    assert len(train) >= 20 and len(held) >= 2
    names_t, names_e = {d.name for d in train}, {d.name for d in held}
    assert not names_t & names_e
    for must in ("email", "json"):
        if must in names_t | names_e:
            assert must in names_e
    share = len(held) / (len(train) + len(held))
    assert 0.03 < share < 0.3, share
    for d in train + held:
        assert d.text.startswith("# file: ")
        headers = [ln for ln in d.text.splitlines() if ln.startswith("# file: ")]
        assert not any(p in ("test", "tests", "idle_test", "site-packages")
                       for h in headers for p in h[len("# file: "):].split("/")[:-1]), d.name
    # one package per document: every header of the "json" document is inside json/
    pkg = next(d for d in train + held if d.name == "json")
    assert all(h.startswith("# file: json/") for h in pkg.text.splitlines() if h.startswith("# file: "))
    assert sum(len(d.text) for d in train) > 1_000_000
    assert load_split(None) == (train, held)


# ------------------------------------------------------------------------------ user sources
def test_folder_text_only_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.txt").write_text("bee\n")
    (tmp_path / "a.txt").write_text("ay ünïcode\n")
    (tmp_path / "sub" / "c.md").write_text("# see\n")
    (tmp_path / "bin.dat").write_bytes(b"abc\x00def")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".git" / "config").write_text("hidden\n")
    docs = load_documents(tmp_path)
    assert [d.name for d in docs] == ["a.txt", "b.txt", "sub/c.md"]
    assert docs[0].text == "ay ünïcode\n"


def test_text_file(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("call me ishmael")
    assert load_documents(f) == [Document("book.txt", "call me ishmael")]


def test_jsonl_and_parquet(tmp_path):
    rows = [{"text": "first doc", "body": "b1"}, {"text": "second", "body": "b2"}, {"text": None, "body": "b3"}]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [d.text for d in load_documents(f)] == ["first doc", "second"]
    assert [d.text for d in load_documents(f, text_field="body")] == ["b1", "b2", "b3"]
    with pytest.raises(DataError, match="data.text_field 'nope'"):
        load_documents(f, text_field="nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match="data.path"):
        load_documents(bad)

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["alpha", "beta", "gamma"]}), tmp_path / "d.parquet")
    docs = load_documents(tmp_path / "d.parquet", text_field="content")
    assert [d.text for d in docs] == ["alpha", "beta", "gamma"]


def test_fasta(tmp_path):
    text = ">chr1 some description\nACGT\nacgtN\n\n>chr2\nGGGG\n;comment\nCC\n"
    (tmp_path / "g.fa").write_text(text)
    with gzip.open(tmp_path / "g2.fasta.gz", "wt") as fh:
        fh.write(text)
    for name in ("g.fa", "g2.fasta.gz"):
        docs = load_documents(tmp_path / name)
        assert [d.text for d in docs] == [b"ACGTacgtN", b"GGGGCC"]
        assert [d.name.split(":")[1] for d in docs] == ["chr1", "chr2"]
    # FASTA inside a folder is read per record, not as one text file
    names = [d.name for d in load_documents(tmp_path)]
    assert names == ["g.fa:chr1", "g.fa:chr2", "g2.fasta.gz:chr1", "g2.fasta.gz:chr2"]


def test_source_errors(tmp_path):
    with pytest.raises(DataError, match=r"data.path '.*nowhere' does not exist"):
        load_documents(tmp_path / "nowhere")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="data.path.*empty"):
        load_documents(tmp_path / "empty.txt")
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="data.path.*no text files"):
        load_documents(tmp_path / "dir")
    (tmp_path / "dir" / "x.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="data.path.*no text files"):
        load_documents(tmp_path / "dir")
    with pytest.raises(DataError, match="data.path.*not a text file"):
        load_documents(tmp_path / "dir" / "x.bin")
    (tmp_path / "e.fa").write_text("")
    with pytest.raises(DataError, match="data.path"):
        load_documents(tmp_path / "e.fa")


def test_split_documents():
    docs = [Document(f"doc{i}", f"text {i} " * 20) for i in range(30)]
    tr, ev = split_documents(docs, 3)
    tr2, ev2 = split_documents(list(reversed(docs)), 3)
    assert len(ev) == 3 and len(tr) == 27
    assert {d.name for d in ev} == {d.name for d in ev2}  # chosen by name, not by position
    assert not {d.name for d in tr} & {d.name for d in ev}
    # a single book: its last tenth is held out
    tr, ev = split_documents([Document("book", "x" * 90 + "y" * 10)], 2)
    assert tr == [Document("book", "x" * 90)] and ev == [Document("book#tail", "y" * 10)]
    assert split_documents(docs, 0) == (docs, [])


# ------------------------------------------------------------------------------ tokenizers
def test_byte_tokenizer():
    tok = load_tokenizer("byte")
    s = "héllo, wörld ✓"
    ids = tok.encode(s)
    assert ids.tolist() == list(s.encode("utf-8")) and tok.vocab_size == 256
    assert tok.decode(ids) == s and tok.decode(torch.tensor(ids.astype(np.int64))) == s
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # truncated sequence decodes with replacement
    assert tok.encode(b"ACGT").tolist() == [65, 67, 71, 84]


def test_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "the dog sat on the log"] * 5, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    for spec in (str(path), str(tmp_path)):  # the file or the folder holding it
        t = load_tokenizer(spec)
        assert t.eos_id == tok.token_to_id("<|endoftext|>")
        ids = t.encode("the cat sat")
        assert ids.tolist() == tok.encode("the cat sat", add_special_tokens=False).ids
        assert t.decode(ids).replace(" ", "") == "thecatsat"
    assert [a.tolist() for a in tokenize_documents(["the mat", "the log"], t, quiet=True)] == \
        [t.encode("the mat").tolist(), t.encode("the log").tolist()]
    with pytest.raises(DataError, match="data.tokenizer '.*missing.json' does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    assert separator_id(t) == t.eos_id and separator_id(t, enabled=False) is None
    assert separator_id(load_tokenizer("byte")) == 0
    plain = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(DataError, match="data.separator"):
        separator_id(load_tokenizer(str(tmp_path / "plain.json")))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "bad.json"))


# ------------------------------------------------------------------------------ packing
EOS = 0


def _docs(n=13, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, size=int(rng.integers(1, 40))).astype(np.int32) for _ in range(n)]


def _stream_tokens(batches):
    """The token stream the windows cover: every window minus its last (overlapping) token."""
    return np.concatenate([r[:-1] for b in batches for r in b.tokens.numpy()])


def _split_eos(stream):
    docs, cur = [], []
    for t in stream:
        if t == EOS:
            docs.append(tuple(cur))
            cur = []
        else:
            cur.append(int(t))
    return docs


def test_packed_windows_cover_each_epoch_once():
    docs = _docs()
    total = sum(len(d) + 1 for d in docs)
    s = PackedStream(docs, seq_len=16, seed=3, eos_id=EOS, batch_size=2)
    batches = [s.next_batch() for _ in range(3 * total // 32 + 2)]
    for b in batches:
        assert b.tokens.dtype == torch.int64 and b.tokens.shape == (2, 17)
        assert torch.equal(b.inputs, b.tokens[:, :-1]) and torch.equal(b.labels, b.tokens[:, 1:])
    rows = [r for b in batches for r in b.tokens.numpy()]
    for a, c in zip(rows, rows[1:]):
        assert a[-1] == c[0]  # windows advance by seq_len: every token is a target exactly once
    stream = _stream_tokens(batches)
    want = sorted(tuple(d.tolist()) for d in docs)
    for e in range(3):  # every epoch holds each document exactly once, in a different order
        assert sorted(_split_eos(stream[e * total:(e + 1) * total])) == want
    assert _split_eos(stream[:total]) != _split_eos(stream[total:2 * total])


def test_doc_ids_and_cu_seqlens():
    docs = _docs(seed=1)
    s = PackedStream(docs, seq_len=24, seed=0, eos_id=EOS, batch_size=3)
    for _ in range(6):
        b = s.next_batch()
        toks, ids = b.tokens.numpy(), b.doc_ids.numpy()
        want_cu = []
        for r in range(3):
            starts = [0] + [j for j in range(1, 25) if toks[r, j - 1] == EOS]
            want_ids = np.cumsum([1 if (j in starts and j > 0) else 0 for j in range(25)])
            assert ids[r].tolist() == want_ids.tolist()
            want_cu += [r * 24 + j for j in starts if j < 24]
        assert b.cu_seqlens().tolist() == want_cu + [3 * 24]


def test_no_separator_doc_ids_mark_runs():
    docs = [np.full(int(n), i + 1, dtype=np.int32) for i, n in enumerate([5, 9, 3, 12, 7])]
    s = PackedStream(docs, seq_len=10, seed=1, eos_id=None, batch_size=1)
    for _ in range(8):
        t, ids = (x[0].numpy() for x in s.next_batch())
        change_t = (t[1:] != t[:-1])
        change_i = (ids[1:] != ids[:-1])
        assert (change_t <= change_i).all()  # a new value always means a new document id
        assert len(set(ids.tolist())) == ids[-1] - ids[0] + 1


def test_resume_exact():
    docs = _docs(seed=2)
    a = PackedStream(docs, seq_len=20, seed=7, eos_id=EOS, batch_size=2)
    for _ in range(7):
        a.next_batch()
    state = a.state_dict()
    assert set(state) >= {"epoch", "cursor", "seed", "seq_len"} and json.dumps(state)
    want = [a.next_batch() for _ in range(5)]
    b = PackedStream(docs, seq_len=20, seed=999, eos_id=EOS, batch_size=2)  # the state's seed wins
    b.load_state_dict(state)
    got = [b.next_batch() for _ in range(5)]
    for w, g in zip(want, got):
        assert torch.equal(w.tokens, g.tokens) and torch.equal(w.doc_ids, g.doc_ids)
    with pytest.raises(DataError, match="different corpus"):
        PackedStream(docs[:-1], seq_len=20, seed=7, eos_id=EOS).load_state_dict(state)


def test_seq_len_change_keeps_cursor():
    docs = _docs(seed=4)
    ref = PackedStream(docs, seq_len=1, seed=5, eos_id=EOS)
    ref_stream = _stream_tokens([ref.next_batch() for _ in range(400)])
    s = PackedStream(docs, seq_len=8, seed=5, eos_id=EOS, batch_size=2)
    got = [s.next_batch() for _ in range(5)]
    s.set_window(32, batch_size=1)  # the next curriculum stage
    got += [s.next_batch() for _ in range(4)]
    t = PackedStream(docs, seq_len=64, seed=5, eos_id=EOS)  # or a fresh object restored from state
    t.load_state_dict(s.state_dict())
    got += [t.next_batch() for _ in range(2)]
    stream = _stream_tokens(got)
    assert len(stream) == 5 * 16 + 4 * 32 + 2 * 64
    assert np.array_equal(stream, ref_stream[:len(stream)])


def test_mixed_stream_deterministic_resumable_weighted():
    a_docs = [np.full(30, 1, np.int32), np.full(17, 2, np.int32)]
    b_docs = [np.full(25, 3, np.int32), np.full(40, 4, np.int32)]

    def make():
        return MixedStream([(PackedStream(a_docs, 8, 0, EOS), 3.0), (PackedStream(b_docs, 8, 1, EOS), 1.0)], seed=11, batch_size=4)

    m = make()
    for _ in range(7):
        m.next_batch()
    state = json.loads(json.dumps(m.state_dict()))
    want = [m.next_batch().tokens for _ in range(5)]
    m2 = make()
    m2.load_state_dict(state)
    assert all(torch.equal(w, m2.next_batch().tokens) for w in want)
    m3 = make()
    rows = torch.cat([m3.next_batch().tokens for _ in range(100)])
    from_a = ((rows == 1) | (rows == 2)).any(1) & ~((rows == 3) | (rows == 4)).any(1)
    assert 0.65 < from_a.float().mean().item() < 0.85  # weight 3:1
    m3.set_window(16, batch_size=2)
    assert m3.next_batch().tokens.shape == (2, 17)


def test_eval_windows_from_doc_starts():
    docs = [np.arange(n, dtype=np.int32) + 100 * i for i, n in enumerate([50, 10, 70, 33, 200])]
    ew = eval_windows(docs, seq_len=32, max_windows=10)
    assert ew.doc_index == [0, 2, 3, 4] and ew.offset == [0, 0, 0, 0]  # doc 1 is too short
    for row, i in zip(ew.tokens, ew.doc_index):
        assert row.tolist() == docs[i][:33].tolist()
    assert eval_windows(docs, 32, max_windows=2).doc_index == [0, 2]
    more = eval_windows(docs, 32, max_windows=7, starts_only=False)
    assert list(zip(more.doc_index, more.offset)) == [(0, 0), (2, 0), (3, 0), (4, 0), (2, 33), (4, 33), (4, 66)]
    for row, i, o in zip(more.tokens, more.doc_index, more.offset):
        assert row.tolist() == docs[i][o:o + 33].tolist()
    with pytest.raises(DataError, match="held-out documents"):
        eval_windows(docs, seq_len=500, max_windows=4)


def test_stdlib_end_to_end_bytes():
    train, held = stdlib_corpus()
    tok = ByteTokenizer()
    toks = tokenize_documents(train[:20], tok, quiet=True)
    b = PackedStream(toks, 256, seed=0, eos_id=tok.eos_id, batch_size=2).next_batch()
    assert b.tokens.max() < tok.vocab_size
    ew = eval_windows(tokenize_documents(held, tok, quiet=True), 1024, 4)
    assert ew.tokens.shape == (4, 1025)
    assert tok.decode(ew.tokens[0][:8]) == "# file: "
