"""The embedded long-context task: questions about real Python files hidden in a long haystack.

Each example is a conversation. The first user turn is a haystack of excerpts of the Python
standard library's own sources (each introduced by `# file: PATH`, shuffled), followed by a
question; further user turns ask more questions about the same haystack. Three kinds of question,
each with one exact answer that appears in the haystack:

    signature  "What is the signature of `quote`?"  -> "quote(string, safe='/', encoding=None, errors=None)"
    returns    "What does `_splitparam` return?"    -> "(url[:i], url[i+1:])"
    file       "Which file defines `unquote`?"      -> "urllib/parse.py"

The name asked about is defined exactly once in the haystack (the example is built so), the answer
is a span of the file as written (the def line, the single `return` expression, the file header),
and the reward is exact match (`exact_match`, a plain function RL can name). No answer can be written
from the question alone (`guessable`): a third of the stdlib's one-line signatures are `name(self)` or
`name()`, which a model that never reads the haystack gets right once it has learnt the answer's form,
and a property's `return self._name` gives itself away the same way; those are not asked.

Files are split as the embedded corpus splits its documents (`data.sources.stdlib_corpus`: the
`email` and `json` packages and one top-level package or module in ten by a stable hash are held
out), so held-out haystacks hold only files a model pretrained on the embedded corpus never saw.
Every example is a pure function of (seed, split, index, length): `TrainExamples` draws a length in
[min_len, the stage's limit] per index, `eval_examples` builds a fixed set per length.

Why our own: the task has to exist on every machine with no download, be exact to the token, and
reach any length from 4k to a stage's limit (a million tokens), which no packaged benchmark does.
"""

from __future__ import annotations

import ast
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import DataError
from .sources import STDLIB_EVAL_ALWAYS, STDLIB_EVAL_SHARE, stable_hash

QUESTIONS = {
    "signature": "What is the signature of `{}`?",
    "returns": "What does `{}` return?",
    "file": "Which file defines `{}`?",
}
KINDS = tuple(QUESTIONS)  # the question kinds, which the setting sft.kinds names
_SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}
_MAX_SIGNATURE = 72   # characters of a signature answer
_MAX_RETURN = 48      # characters of a return-expression answer
_MAX_RETURN_LINES = 60  # longer functions are not asked what they return (and rarely fit a haystack)
_DEFS = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)", re.M)
_TRIVIAL_RETURNS = {"None", "True", "False", "self", "0", "1", "''", '""', "[]", "{}", "()", "NotImplemented"}


def exact_match(completion: str, answer: str) -> float:
    """The task's reward: 1.0 when the completion is the answer (surrounding whitespace aside), else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


# ------------------------------------------------------------------------------ the files
@dataclass(frozen=True)
class Fact:
    kind: str
    name: str
    answer: str
    start: int   # the definition's first line (0-based, its decorators included)
    need: int    # lines from there that hold what the answer is read from (the def line, the return)


@dataclass
class SourceFile:
    path: str                                  # relative to the stdlib root: "email/utils.py"
    lines: list[str]                           # with their line ends
    facts: list[Fact] = field(default_factory=list)

    def text(self, a: int, b: int) -> str:
        return "".join(self.lines[a:b])


def guessable(kind: str, name: str, answer: str) -> bool:
    """Whether the answer can be written without the haystack (no parameters but self or cls; a constant
    return or a property's own attribute): such facts are not asked, or an accuracy would count guesses
    as reads."""
    if kind == "signature":
        return re.fullmatch(re.escape(name) + r"\(\s*(?:self|cls)?\s*\)", answer) is not None
    if kind == "returns":
        return answer in _TRIVIAL_RETURNS or re.fullmatch(r"(?:self|cls)\._{0,2}" + re.escape(name.lstrip("_")),
                                                          answer) is not None
    return False


def _own_returns(fn) -> list:
    """The Return statements of fn itself (not of functions, lambdas or classes inside it)."""
    out, todo = [], list(fn.body)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Return):
            out.append(n)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        todo.extend(ast.iter_child_nodes(n))
    return out


def _signature(line: str, name: str) -> str | None:
    """`name(params)` from a one-line def, or None (multi-line, too long)."""
    m = re.search(r"\bdef\s+" + re.escape(name) + r"\(", line)
    if not m:
        return None
    i, depth = m.end() - 1, 0
    for j in range(i, len(line)):
        depth += {"(": 1, ")": -1}.get(line[j], 0)
        if depth == 0:
            sig = name + line[i:j + 1]
            return sig if len(sig) <= _MAX_SIGNATURE and "#" not in sig else None
    return None


def _segment(lines: list[str], node) -> str | None:
    """The source of a one-line node (ast's column offsets count UTF-8 bytes); None when it spans lines.
    ast.get_source_segment would split the whole file again for every call."""
    if node.lineno != node.end_lineno:
        return None
    line = lines[node.lineno - 1].encode("utf-8")
    return line[node.col_offset:node.end_col_offset].decode("utf-8", errors="replace")


def parse_file(root: Path, f: Path) -> SourceFile | None:
    """A file's sibling statements and the facts questions can ask about; None when it does not parse."""
    raw = f.read_bytes()
    try:
        text = raw.decode("utf-8")
        tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    sf = SourceFile(f.relative_to(root).as_posix(), lines)
    names: dict[str, int] = {}  # every def/class of the file, nested ones too (a regex: walking the tree is slow)
    for name in _DEFS.findall(text):
        names[name] = names.get(name, 0) + 1
    bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for body in bodies:
        for n in body:
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            name = n.name
            if names.get(name) != 1 or (name.startswith("__") and name.endswith("__")):
                continue
            start = min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1
            head = n.lineno - start  # through the def line
            sf.facts.append(Fact("file", name, sf.path, start, head))
            sig = _signature(lines[n.lineno - 1], name)
            if sig is not None and not guessable("signature", name, sig):
                sf.facts.append(Fact("signature", name, sig, start, head))
            if n.end_lineno - start > _MAX_RETURN_LINES:
                continue
            rets = _own_returns(n)
            if len(rets) == 1 and rets[0].value is not None:
                seg = _segment(lines, rets[0].value)
                if seg and len(seg) <= _MAX_RETURN and not guessable("returns", name, seg):
                    sf.facts.append(Fact("returns", name, seg, start, rets[0].end_lineno - start))
    return sf


def stdlib_files(root: str | os.PathLike | None = None, packages: Sequence[str] | None = None) -> tuple[list[Path], list[Path], Path]:
    """(train files, held-out files, root): the stdlib's .py files (no test suites), split by their
    top-level package or module as `stdlib_corpus` splits its documents. `packages` keeps only those
    top-level names (tests use a few)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if packages is not None and entry.name not in packages:
            continue
        if entry.is_dir():
            if entry.name in _SKIP_DIRS or entry.name.startswith(".") or not (entry / "__init__.py").is_file():
                continue
            files = []
            for dirpath, dirnames, filenames in os.walk(entry):
                dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
                files += [Path(dirpath) / fn for fn in sorted(filenames) if fn.endswith(".py")]
        elif entry.suffix == ".py" and not entry.name.startswith("_sysconfigdata"):
            files = [entry]
        else:
            continue
        out = held if entry.name in STDLIB_EVAL_ALWAYS or stable_hash(entry.name) % STDLIB_EVAL_SHARE == 0 else train
        out.extend(files)
    return train, held, root


# ------------------------------------------------------------------------------ examples
@dataclass
class Example:
    messages: list[dict]      # the conversation, the gold answers in its assistant turns
    questions: list[str]
    answers: list[str]
    kinds: list[str]
    length: int               # the length it was built for (tokens of the encoded conversation, at most)


class RetrievalTask:
    """Examples from one split of the files. `count(text)` is the tokens a text encodes to (the byte
    tokenizer: its UTF-8 bytes); `overhead(messages)` the tokens of the conversation as the chat
    template encodes it (with an empty haystack: what the turns around the haystack cost)."""

    def __init__(self, files: Sequence[Path], root: Path, seed: int, count: Callable[[str], int],
                 overhead: Callable[[list[dict]], int], questions: int = 4, kinds: Sequence[str] = KINDS,
                 split: str = "train", ask_first: bool = False):
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise DataError(f"sft.kinds has {bad[0] if bad else 'nothing'!r}; choose from {', '.join(KINDS)}.")
        if questions < 1:
            raise DataError(f"sft.questions must be >= 1 (got {questions}); ask at least one question per haystack.")
        self.files = [sf for f in files if (sf := parse_file(root, f)) is not None and sf.lines]
        self.kinds, self.questions, self.seed, self.split = tuple(kinds), questions, int(seed), split
        self.ask_first = bool(ask_first)
        self.count, self.overhead = count, overhead
        self._by_kind = {k: [(fi, j) for fi, sf in enumerate(self.files) for j, fa in enumerate(sf.facts) if fa.kind == k]
                         for k in self.kinds}
        empty = [k for k, v in self._by_kind.items() if not v]
        if empty:
            raise DataError(f"the {split} files have no question of kind {empty[0]!r}; drop it from sft.kinds.")
        self._cum: dict[int, np.ndarray] = {}

    def _size(self, fi: int, a: int, b: int) -> int:
        """Tokens of lines [a, b) of file fi (the sum over its lines: exact for bytes, close for BPE)."""
        if fi not in self._cum:
            c = np.zeros(len(self.files[fi].lines) + 1, dtype=np.int64)
            np.cumsum([self.count(x) for x in self.files[fi].lines], out=c[1:])
            self._cum[fi] = c
        c = self._cum[fi]
        return int(c[b] - c[a])

    def example(self, index: int, length: int) -> Example:
        """Example `index` of this split, built to encode to at most `length` tokens (and close to it)."""
        rng = np.random.default_rng([self.seed, {"train": 0, "eval": 1}[self.split], length, index])
        for _ in range(50):  # a draw whose names collide, or that cannot fit, is drawn again
            ex = self._try(rng, length)
            if ex is not None:
                return ex
        raise DataError(f"sft: no {length}-token haystack could be built from the {len(self.files)} {self.split} "
                        "files with the questions asked; lower sft.questions or use longer stages.")

    def _try(self, rng, length: int) -> Example | None:
        q = self.questions
        facts, used = [], set()
        for _ in range(q):
            kind = self.kinds[int(rng.integers(len(self.kinds)))]
            pool = self._by_kind[kind]
            for _ in range(50):
                fi, j = pool[int(rng.integers(len(pool)))]
                fa = self.files[fi].facts[j]
                if fi not in used and fa.name not in {f.name for _, f in facts}:
                    facts.append((fi, fa))
                    used.add(fi)
                    break
            else:
                return None
        questions = [QUESTIONS[fa.kind].format(fa.name) for _, fa in facts]
        answers = [fa.answer for _, fa in facts]
        budget = length - self.overhead(_messages("", questions, answers, self.ask_first))
        names = re.compile(r"\b(?:def|class)\s+(?:" + "|".join(re.escape(f.name) for _, f in facts) + r")\b")
        pieces = [[fi, fa.start, fa.start + fa.need] for fi, fa in facts]  # [file, first line, end line)
        total = sum(self._size(fi, a, b) + self._header(fi) for fi, a, b in pieces)
        if total > budget:
            return None
        targets, misses = len(pieces), 0
        while misses < 40 and budget - total > 8:
            room = budget - total
            if rng.random() < 0.4:  # a target's excerpt grows by a few lines, up or down
                p = pieces[int(rng.integers(targets))]
                k = int(rng.integers(1, 9))
                a, b = (max(0, p[1] - k), p[2]) if rng.random() < 0.4 else (p[1], min(len(self.files[p[0]].lines), p[2] + k))
                new = self.files[p[0]].text(a, p[1]) + self.files[p[0]].text(p[2], b)
                grow = self._size(p[0], a, b) - self._size(p[0], p[1], p[2])
                if not new or grow > room or names.search(new):
                    misses += 1
                    continue
                p[1], p[2] = a, b
                total += grow
                continue
            fi = int(rng.integers(len(self.files)))  # a distractor: lines of a file no question is about
            if fi in used:
                misses += 1
                continue
            sf = self.files[fi]
            want = min(room - self._header(fi), int(rng.integers(128, 2048)))
            a = int(rng.integers(len(sf.lines)))
            b = a
            while b < len(sf.lines) and self._size(fi, a, b + 1) <= want:
                b += 1
            if not sf.text(a, b).strip() or names.search(sf.text(a, b)):
                misses += 1
                continue
            pieces.append([fi, a, b])
            used.add(fi)
            total += self._size(fi, a, b) + self._header(fi)
        order = rng.permutation(len(pieces))
        hay = "\n".join(f"# file: {self.files[pieces[i][0]].path}\n" + self.files[pieces[i][0]].text(*pieces[i][1:])
                        for i in order)
        for _, fa in facts:  # the name is defined once in the whole haystack, in its own file's excerpt
            if len(re.findall(r"\b(?:def|class)\s+" + re.escape(fa.name) + r"\b", hay)) != 1:
                return None
        msgs = _messages(hay, questions, answers, self.ask_first)
        if self.overhead(msgs) > length:  # a BPE tokenizer merges across lines a little differently
            return None
        return Example(msgs, questions, answers, [fa.kind for _, fa in facts], length)

    def _header(self, fi: int) -> int:
        return self.count(f"# file: {self.files[fi].path}\n") + 1  # and the newline between pieces


def _messages(haystack: str, questions: list[str], answers: list[str], ask_first: bool = False) -> list[dict]:
    """The conversation: the haystack and the first question in the first user turn, a turn per further
    question. ask_first: that turn opens with every question, so a reader of the haystack knows what to
    keep (a recurrent state can hold one definition where it cannot hold the whole haystack)."""
    head = "Questions:\n" + "\n".join(questions) + "\n\n" if ask_first else ""
    msgs = []
    for i, (qu, an) in enumerate(zip(questions, answers)):
        msgs.append({"role": "user", "content": f"{head}{haystack}\n\n{qu}" if i == 0 else qu})
        msgs.append({"role": "assistant", "content": an})
    return msgs


class TrainExamples:
    """The training split's examples as a source for `ChatStream`: example k is drawn at a length in
    [min_len, limit] (limit: the stage's seq_len; min_len above it is taken as the limit)."""

    def __init__(self, task: RetrievalTask, encode, min_len: int):
        self.task, self.encode, self.min_len = task, encode, int(min_len)

    def get(self, k: int, limit: int):
        lo = min(self.min_len, limit)
        rng = np.random.default_rng([self.task.seed, 2, k])
        length = int(rng.integers(lo, limit + 1))
        return self.encode(self.task.example(k, length).messages, f"task example {k}")

    def state_key(self) -> tuple:
        return ("retrieval", self.task.seed, self.task.questions, self.task.kinds, self.min_len, self.task.ask_first)


def eval_examples(task: RetrievalTask, lengths: Sequence[int], n: int) -> dict[int, list[Example]]:
    """n held-out examples per length, the same for every run with the same seed."""
    return {L: [task.example(i, L) for i in range(n)] for L in lengths}
