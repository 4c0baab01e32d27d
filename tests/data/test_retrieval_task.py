"""The embedded long-context task: real files, one exact answer per question, lengths, determinism,
the held-out split, the reward."""

from __future__ import annotations

import re

import pytest

from longctx.data.chat import ByteChatTemplate
from longctx.data.retrieval_task import (
    KINDS,
    RetrievalTask,
    TrainExamples,
    eval_examples,
    exact_match,
    parse_file,
    stdlib_files,
)
from longctx.data.sources import stdlib_corpus
from longctx.errors import DataError

TPL = ByteChatTemplate()
# a few packages of each split: the whole stdlib takes seconds to parse
PACKAGES = ("json", "email", "glob.py", "fractions.py", "hmac.py", "argparse.py", "textwrap.py", "base64.py",
            "csv.py", "shlex.py", "difflib.py", "calendar.py", "http")


def _count(text: str) -> int:
    return len(text.encode("utf-8"))


def _size(msgs) -> int:
    return len(TPL.encode(msgs))


@pytest.fixture(scope="module")
def tasks():
    train, held, root = stdlib_files(packages=PACKAGES)
    return (RetrievalTask(train, root, 0, _count, _size, questions=3),
            RetrievalTask(held, root, 0, _count, _size, questions=3, split="eval"), root)


def test_files_split_as_the_embedded_corpus_splits_its_documents(tasks):
    train, held, _ = tasks
    held_docs = {d.name for d in stdlib_corpus()[1]}
    top = {f.path.split("/")[0] if "/" in f.path else f.path for f in held.files}
    assert top <= held_docs and {"json", "email", "glob.py"} <= top
    assert not {f.path for f in train.files} & {f.path for f in held.files}
    assert all(f.path.split("/")[0] not in held_docs for f in train.files) and len(train.files) > 5


@pytest.mark.parametrize("length", [1024, 4096, 16384])
def test_examples_fill_their_length_and_ask_what_the_haystack_answers(tasks, length):
    _, held, _ = tasks
    kinds_seen = set()
    for i in range(6):
        ex = held.example(i, length)
        enc = TPL.encode(ex.messages)
        assert 0.9 * length <= len(enc) <= length
        hay = ex.messages[0]["content"]
        assert len(ex.questions) == 3 and [m["role"] for m in ex.messages] == ["user", "assistant"] * 3
        headers = re.findall(r"^# file: (\S+)$", hay, re.M)
        assert len(headers) == len(set(headers))  # one excerpt per file
        assert set(headers) <= {f.path for f in held.files}
        for q, a, k in zip(ex.questions, ex.answers, ex.kinds):
            name = re.search(r"`(\w+)`", q).group(1)
            defs = [m.start() for m in re.finditer(r"\b(?:def|class)\s+" + name + r"\b", hay)]
            assert len(defs) == 1, (q, defs)  # defined exactly once in the haystack
            owner = [h for h in re.finditer(r"^# file: (\S+)$", hay, re.M) if h.start() < defs[0]][-1].group(1)
            if k == "file":
                assert a == owner
            elif k == "signature":
                assert a.startswith(name + "(") and ("def " + a) in hay
                # something between the parentheses that only the haystack says
                assert re.sub(r"\b(self|cls)\b", "", a[len(name) + 1:-1]).strip(" ,"), a
            else:
                assert a in hay[defs[0]:]
            kinds_seen.add(k)
        # the trained tokens are the answers, each followed by the end-of-turn byte
        assert [bytes(enc.tokens[s:e - 1].tolist()).decode() for _, s, e in enc.spans] == ex.answers
    assert kinds_seen


def test_examples_are_deterministic_by_seed_and_index(tasks):
    train, held, root = tasks
    assert held.example(3, 2048) == held.example(3, 2048)
    assert held.example(3, 2048) != held.example(4, 2048)
    other = RetrievalTask(stdlib_files(packages=PACKAGES)[1], root, 1, _count, _size, questions=3, split="eval")
    assert other.example(3, 2048) != held.example(3, 2048)
    evs = eval_examples(held, [1024, 2048], 2)
    assert list(evs) == [1024, 2048] and evs[2048][1] == held.example(1, 2048)
    src = TrainExamples(train, TPL.encode, min_len=1024)
    lens = [len(src.get(k, 4096)) for k in range(8)]
    assert all(900 <= n <= 4096 for n in lens) and len(set(lens)) > 1
    assert src.get(5, 4096).tokens.tolist() == src.get(5, 4096).tokens.tolist()
    assert all(len(src.get(k, 800)) <= 800 for k in range(3))  # a stage shorter than min_len: its own length


def test_the_sft_retrieval_presets_shortest_haystacks_can_be_built():
    from longctx.config.loading import load_train_config

    c = load_train_config(None, "sft-retrieval", [])
    train, held, root = stdlib_files(packages=PACKAGES)
    for files, split in ((train, "train"), (held, "eval")):
        task = RetrievalTask(files, root, 0, _count, _size, c.sft.questions, c.sft.kinds, split=split)
        assert all(len(TPL.encode(task.example(i, c.sft.min_len).messages)) <= c.sft.min_len for i in range(8))


def test_kinds_and_bad_settings(tasks):
    train, _, root = tasks
    only = RetrievalTask(stdlib_files(packages=PACKAGES)[0], root, 0, _count, _size, questions=2, kinds=["signature"])
    assert {k for i in range(5) for k in only.example(i, 2048).kinds} == {"signature"}
    with pytest.raises(DataError, match="sft.kinds"):
        RetrievalTask([], root, 0, _count, _size, kinds=["colour"])
    with pytest.raises(DataError, match="no 256-token haystack"):
        train.example(0, 256)


def test_facts_read_from_the_source(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\n@staticmethod\ndef scale(x, factor=2):\n    y = x * factor\n    return y + 1\n\n"
                 "def twice(n):\n    if n:\n        return n\n    return 0\n\n"
                 "class C:\n    def method(self, a, *, b=None) -> int:\n        return a.b\n\n"
                 "def __dunder__(x):\n    return x\n\n"
                 "class D:\n    def size(self):\n        return self._size\n    def reset(self):\n        return self.n\n"
                 "    @classmethod\n    def make(cls):\n        return cls(1)\n\ndef now():\n    return clock()\n")
    sf = parse_file(tmp_path, f)
    got = {(fa.kind, fa.name): fa.answer for fa in sf.facts}
    assert got[("signature", "scale")] == "scale(x, factor=2)"
    assert got[("returns", "scale")] == "y + 1"
    assert got[("signature", "method")] == "method(self, a, *, b=None)" and got[("returns", "method")] == "a.b"
    assert ("returns", "twice") not in got  # two returns: no single answer
    assert got[("file", "scale")] == "m.py"
    assert not any(n == "__dunder__" for _, n in got)
    # what the question's name gives away is not asked: no parameters but self / cls, a property's attribute
    assert not any(k == "signature" and n in ("size", "reset", "make", "now") for k, n in got)
    assert ("returns", "size") not in got
    assert got[("returns", "reset")] == "self.n" and got[("returns", "make")] == "cls(1)" and got[("returns", "now")] == "clock()"
    scale = next(fa for fa in sf.facts if fa.name == "scale" and fa.kind == "returns")
    assert sf.lines[scale.start].startswith("@staticmethod") and sf.lines[scale.start + scale.need - 1].strip() == "return y + 1"


def test_exact_match_is_the_reward():
    assert exact_match("urllib/parse.py", "urllib/parse.py") == 1.0
    assert exact_match("  urllib/parse.py\n", "urllib/parse.py") == 1.0
    assert exact_match("urllib/parse.pyc", "urllib/parse.py") == 0.0
    assert exact_match("", "x") == 0.0
    assert KINDS == ("signature", "returns", "file")


def test_ask_first_states_every_question_before_the_same_kind_of_haystack(tasks):
    """sft.ask_first: the first user turn opens with every question, then the haystack and the first
    question as before; the answers, the trained spans and the length budget are the task's own."""
    _, held, root = tasks
    first = RetrievalTask(stdlib_files(packages=PACKAGES)[1], root, 0, _count, _size, questions=3,
                          split="eval", ask_first=True)
    for i in range(3):
        ex = first.example(i, 2048)
        turn = ex.messages[0]["content"]
        assert turn.startswith("Questions:\n" + "\n".join(ex.questions) + "\n\n")
        assert turn.endswith("\n\n" + ex.questions[0]) and "# file: " in turn
        assert turn.index(ex.questions[2]) < turn.index("# file: ")  # asked before the haystack is read
        enc = TPL.encode(ex.messages)
        assert 0.9 * 2048 <= len(enc) <= 2048
        assert [bytes(enc.tokens[s:e - 1].tolist()).decode() for _, s, e in enc.spans] == ex.answers
    plain = held.example(0, 2048)
    assert not plain.messages[0]["content"].startswith("Questions:")
    assert TrainExamples(first, TPL.encode, 512).state_key() != TrainExamples(held, TPL.encode, 512).state_key()
