"""Conversations for post-training: checked messages, a chat template, per-token loss weights.

A conversation is a list of messages in the usual chat form::

    {"role": "system" | "user" | "assistant" | "tool", "content": "...",
     "tool_calls": [{"name": "f", "arguments": {...}}],    # assistant only; OpenAI's
                                                            # {"type": "function", "function": {...}} too
     "name": "...", "tool_call_id": "...",                  # optional (tool results)
     "weight": 0}                                           # optional: 0 = an assistant turn not trained on

`check_messages` turns it into one canonical form (or raises one DataError sentence naming the
conversation and the message). A template turns it into token ids and a weight per token: the loss
weight of that token *as a target*. Only what the assistant wrote carries weight (its content, its
tool calls and its end-of-turn token, so the model learns to stop); the system prompt, the user's
turns, tool output and the assistant's role header weigh 0. `EncodedChat.labels` gives the labels
the loss paths take (-100 where the weight is 0); RL reads `weights` and `spans` (where each
assistant turn's trained tokens are) directly.

Two templates:

* `ByteChatTemplate` ("longctx"), the documented template of the byte tokenizer. Its markers are
  bytes that UTF-8 text never contains (0xF5..0xFE), so no content can forge or break a marker and
  the rendering decodes back to the very messages (`decode`)::

      F5 system F6 user F7 assistant F8 tool        a turn begins (the role byte)
      FB {"name": .., "tool_call_id": ..} FC        the message's name / tool_call_id, when given
      F9 {"name": .., "arguments": ..} FA           one tool call (after the assistant's content)
      FE                                            the turn ends (the assistant's stop token)

  e.g. `F6 "What is 2+2?" FE F7 "4" FE`; the weights are 1 on "4" and on the FE after it. A
  generation prompt is the conversation so far followed by F7.

* `JinjaChatTemplate`, the tokenizer's own template (HF's `chat_template`: in tokenizer_config.json
  or chat_template.jinja beside tokenizer.json, or a .jinja file given as sft.template). Each
  assistant turn's trained text is found by rendering the conversation up to it with the generation
  prompt and up to its end: the text in between is the turn (this needs a template whose renderings
  of a conversation's beginnings are prefixes of the whole, as ChatML-style templates are).

Our own code: the masks must be exact to the token, and the byte template has to exist; HF's
`apply_chat_template` renders text and masks only templates with `{% generation %}` tags.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import DataError, did_you_mean

ROLES = ("system", "user", "assistant", "tool")
_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id", "weight")


# ------------------------------------------------------------------------------ messages
def check_messages(messages, where: str = "the conversation") -> list[dict]:
    """The canonical form of one conversation, or a DataError naming `where` and the message.

    Canonical: every message has "role" and "content" (a str; "" for an assistant turn that only
    calls tools); "tool_calls" (assistant only) is a list of {"name", "arguments"[, "id"]};
    "name", "tool_call_id" (str) and "weight" (0 or 1; assistant only) appear only when given.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where} has no messages (got {_short(messages)}); give a non-empty list of "
                        "{\"role\": ..., \"content\": ...} objects.")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}, message {i}"
        if not isinstance(m, dict):
            raise DataError(f"{at} is {type(m).__name__}, not an object; write each message as "
                            "{\"role\": ..., \"content\": ...}.")
        role = m.get("role")
        if role is None:
            raise DataError(f"{at} has no role; give every message a role (system, user, assistant or tool).")
        if role not in ROLES:
            hint = did_you_mean(str(role), ROLES) or "; use system, user, assistant or tool."
            raise DataError(f"{at} has the unknown role {_short(role)}{hint}")
        for k in m:
            if k not in _KEYS:
                raise DataError(f"{at} has the unknown field {k!r}"
                                + (did_you_mean(str(k), _KEYS) or f"; a message takes {', '.join(_KEYS)}."))
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise DataError(f"{at} is a {role} message with tool_calls; only assistant messages call tools.")
        if content is None and not (role == "assistant" and calls):
            raise DataError(f"{at} ({role}) has no content; give it a \"content\" string.")
        if content is not None and not isinstance(content, str):
            raise DataError(f"{at} has content of type {type(content).__name__}; make \"content\" a string.")
        msg = {"role": role, "content": content or ""}
        if calls is not None:
            msg["tool_calls"] = [_check_call(c, f"{at}, tool call {j}") for j, c in enumerate(_as_list(calls, at))]
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None:
                if not isinstance(m[k], str):
                    raise DataError(f"{at} has a {k} of type {type(m[k]).__name__}; make it a string.")
                msg[k] = m[k]
        if m.get("weight") is not None:
            w = m["weight"]
            if role != "assistant":
                raise DataError(f"{at} is a {role} message with a weight; only assistant turns are trained on, "
                                "so drop its weight.")
            if isinstance(w, bool) or w not in (0, 1):  # the loss paths take a mask, not fractional weights
                raise DataError(f"{at} has the weight {_short(w)}; give 0 (not trained on) or 1.")
            msg["weight"] = float(w)
        out.append(msg)
    return out


def _as_list(calls, at: str) -> list:
    if not isinstance(calls, (list, tuple)):
        raise DataError(f"{at} has tool_calls of type {type(calls).__name__}; make it a list of calls.")
    return list(calls)


def _check_call(c, at: str) -> dict:
    if not isinstance(c, dict):
        raise DataError(f"{at} is {type(c).__name__}, not an object; write it as {{\"name\": ..., \"arguments\": ...}}.")
    f = c.get("function") if isinstance(c.get("function"), dict) else c  # OpenAI's {"type": "function", "function": {..}}
    name, args = f.get("name"), f.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise DataError(f"{at} has no function name; give it \"name\" (or \"function\": {{\"name\": ...}}).")
    try:
        json.dumps(args)
    except (TypeError, ValueError):
        raise DataError(f"{at} ({name}) has arguments that are not JSON; give an object or a string.") from None
    call = {"name": name, "arguments": args}
    if c.get("id") is not None:
        call["id"] = str(c["id"])
    return call


def read_conversations(path: str | os.PathLike, field: str = "messages", setting: str = "data.path") -> list[tuple[str, list[dict]]]:
    """Every conversation in a local .jsonl or .parquet file (or a folder of them, in sorted order):
    one per row, its messages under `field`; checked (`check_messages`), each error naming the row.
    Returns (where, messages) pairs: where names the file and line (or row)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{setting} '{path}' does not exist; point it at a .jsonl or .parquet file of conversations.")
    files = sorted(f for f in p.rglob("*") if f.suffix.lower() in (".jsonl", ".parquet") and f.is_file()) if p.is_dir() else [p]
    if not files:
        raise DataError(f"{setting} '{path}' holds no .jsonl or .parquet files; point it at conversations in one of those.")
    out = []
    for f in files:
        if f.suffix.lower() not in (".jsonl", ".parquet"):
            raise DataError(f"{setting} '{f}' is not .jsonl or .parquet; write the conversations as JSON lines "
                            f"(one {{\"{field}\": [...]}} per line) or Parquet.")
        for where, row in _rows(f, setting):
            if not isinstance(row, dict) or field not in row:
                keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise DataError(f"{where} has no {field!r} field (it has {keys or 'nothing'}); set sft.messages_field "
                                "to the field that holds the messages.")
            out.append((where, check_messages(row[field], where)))
    if not out:
        raise DataError(f"{setting} '{path}' has no conversations (it is empty); give at least one.")
    return out


def _rows(f: Path, setting: str):
    if f.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(f"{setting} '{f}' needs the pyarrow package to read Parquet; `pip install pyarrow`.") from e
        try:
            rows = pq.read_table(f).to_pylist()
        except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family
            raise DataError(f"{setting} '{f}' is not valid Parquet ({_first_line(e)}); fix the file.") from e
        for i, r in enumerate(rows):
            yield f"{setting} '{f}' row {i}", r
        return
    with open(f, encoding="utf-8", errors="strict") as fh:
        try:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{setting} '{f}' line {n} is not JSON ({e.msg}); write one JSON object per line.") from None
                yield f"{setting} '{f}' line {n}", row
        except UnicodeDecodeError:
            raise DataError(f"{setting} '{f}' is not UTF-8 text; save it as UTF-8.") from None


# ------------------------------------------------------------------------------ encoded conversations
class EncodedChat(NamedTuple):
    tokens: np.ndarray   # int64 [n]
    weights: np.ndarray  # float32 [n]: the loss weight of tokens[i] as a target (0: not trained on)
    spans: list          # [(message index, start, end)]: each assistant turn's trained tokens [start, end)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def labels(self) -> np.ndarray:
        """int64 [n]: labels[i] = tokens[i + 1] where that token carries weight, else -100 (and -100 at
        the last position, which predicts nothing)."""
        lab = np.full(len(self.tokens), -100, dtype=np.int64)
        keep = self.weights[1:] > 0
        lab[:-1][keep] = self.tokens[1:][keep]
        return lab


def _encode_pieces(pieces: Sequence[tuple[np.ndarray, float, int | None]]) -> EncodedChat:
    """(ids, weight, assistant message index or None) pieces -> one EncodedChat."""
    toks = [np.asarray(p[0], dtype=np.int64) for p in pieces]
    tokens = np.concatenate(toks) if toks else np.zeros(0, np.int64)
    weights = np.concatenate([np.full(len(t), w, np.float32) for t, (_, w, _) in zip(toks, pieces)]) if toks else \
        np.zeros(0, np.float32)
    spans, pos = [], 0
    for t, (_, w, mi) in zip(toks, pieces):
        if mi is not None and len(t):
            spans.append((mi, pos, pos + len(t)))
        pos += len(t)
    return EncodedChat(tokens, weights, spans)


def _turn_weight(m: dict) -> float:
    return m.get("weight", 1.0)


# ------------------------------------------------------------------------------ the byte template
SYSTEM, USER, ASSISTANT, TOOL = 0xF5, 0xF6, 0xF7, 0xF8
CALL, CALL_END, META, META_END, END = 0xF9, 0xFA, 0xFB, 0xFC, 0xFE
_ROLE_BYTE = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
_BYTE_ROLE = {v: k for k, v in _ROLE_BYTE.items()}
_MARK_NAMES = {SYSTEM: "<|system|>", USER: "<|user|>", ASSISTANT: "<|assistant|>", TOOL: "<|tool|>", CALL: "<|call|>",
               CALL_END: "<|/call|>", META: "<|meta|>", META_END: "<|/meta|>", END: "<|end|>"}


def _utf8(s: str) -> np.ndarray:
    return np.frombuffer(s.encode("utf-8"), dtype=np.uint8)


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True)
class ByteChatTemplate:
    """The longctx template of the byte tokenizer (see the module docstring)."""

    name = "longctx"
    stop_ids = (END,)

    def _turn(self, m: dict) -> tuple[list, list]:
        """(header ids, body ids) of one message; the body ends with END."""
        head = [_ROLE_BYTE[m["role"]]]
        meta = {k: m[k] for k in ("name", "tool_call_id") if k in m}
        body = []
        if meta:
            body += [META, *_utf8(_json(meta)), META_END]
        body += list(_utf8(m["content"]))
        for c in m.get("tool_calls", ()):
            body += [CALL, *_utf8(_json(c)), CALL_END]
        return head, body + [END]

    def encode(self, messages, where: str = "the conversation") -> EncodedChat:
        msgs = check_messages(messages, where)
        pieces = []
        for i, m in enumerate(msgs):
            head, body = self._turn(m)
            pieces.append((np.asarray(head), 0.0, None))
            trained = m["role"] == "assistant" and _turn_weight(m) > 0
            pieces.append((np.asarray(body), _turn_weight(m) if trained else 0.0, i if trained else None))
        return _encode_pieces(pieces)

    def generation_prompt(self, messages, where: str = "the conversation") -> np.ndarray:
        """The conversation so far and the assistant's role byte: what the model continues."""
        msgs = check_messages(messages, where)
        ids = [t for m in msgs for part in self._turn(m) for t in part]
        return np.asarray(ids + [ASSISTANT], dtype=np.int64)

    def decode(self, ids) -> list[dict]:
        """Token ids (a whole rendering) back to the canonical messages; ValueError on ids that are
        not one."""
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1))
        out, pos = [], 0
        while pos < len(data):
            role = _BYTE_ROLE.get(data[pos])
            if role is None:
                raise ValueError(f"byte {pos} (0x{data[pos]:02x}) does not begin a turn")
            end = data.find(bytes([END]), pos)
            if end < 0:
                raise ValueError(f"the {role} turn at byte {pos} has no end marker")
            msg = {"role": role, **self.parse_body(data[pos + 1:end])}
            out.append(msg)
            pos = end + 1
        return out

    def parse_body(self, body: bytes) -> dict:
        """One turn's body (without its role byte and END) -> {"content"[, "tool_calls", "name", ...]}.
        Also what a sampled completion is read with (`completion`)."""
        msg: dict = {}
        if body[:1] == bytes([META]):
            stop = body.index(bytes([META_END]))
            msg.update(json.loads(body[1:stop].decode("utf-8")))
            body = body[stop + 1:]
        cut = body.find(bytes([CALL]))
        text = body if cut < 0 else body[:cut]
        calls = []
        while cut >= 0:
            stop = body.index(bytes([CALL_END]), cut)
            calls.append(json.loads(body[cut + 1:stop].decode("utf-8")))
            cut = body.find(bytes([CALL]), stop)
        out = {"content": text.decode("utf-8")}
        if calls:
            out["tool_calls"] = calls
        out.update(msg)
        return out

    def completion(self, ids) -> dict:
        """A sampled assistant turn (the ids after the generation prompt, up to END or the end) as a
        message; bytes that are not UTF-8 become U+FFFD, unfinished calls stay in the content."""
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1))
        end = data.find(bytes([END]))
        data = data if end < 0 else data[:end]
        try:
            return {"role": "assistant", **self.parse_body(data)}
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError):
            return {"role": "assistant", "content": data.decode("utf-8", errors="replace")}

    def text(self, ids) -> str:
        """A rendering for people: the markers as <|user|>, <|end|>, ..."""
        data = bytes(int(i) for i in np.asarray(ids).reshape(-1))
        out, run = [], bytearray()
        for b in data:
            if b in _MARK_NAMES:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                out.append(_MARK_NAMES[b])
            else:
                run.append(b)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


# ------------------------------------------------------------------------------ a tokenizer's own template
class JinjaChatTemplate:
    """A HF-style Jinja chat template over a tokenizer (see the module docstring)."""

    def __init__(self, source: str, tokenizer, name: str = "jinja", special: dict | None = None):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:
            raise DataError(f"sft.template {name!r} is a Jinja template, which needs the jinja2 package; "
                            "`pip install jinja2`.") from e

        def raise_exception(msg):
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
        try:
            self._tpl = env.from_string(source)
        except TemplateError as e:
            raise DataError(f"the chat template {name!r} is not valid Jinja ({_first_line(e)}); fix it or set "
                            "sft.template to another template.") from None
        self.tokenizer, self.name, self.special = tokenizer, name, dict(special or {})
        eos = getattr(tokenizer, "eos_id", None)
        self.stop_ids = () if eos is None else (eos,)

    def render(self, msgs: list[dict], add_generation_prompt: bool, where: str) -> str:
        from jinja2 import TemplateError

        hf = [_hf_message(m) for m in msgs]
        try:
            return self._tpl.render(messages=hf, add_generation_prompt=add_generation_prompt, tools=None, **self.special)
        except (TemplateError, TypeError, KeyError, AttributeError, ValueError) as e:
            raise DataError(f"{where}: the chat template {self.name!r} could not render it ({_first_line(e)}); "
                            "fix the conversation or set sft.template to another template.") from None

    def encode(self, messages, where: str = "the conversation") -> EncodedChat:
        msgs = check_messages(messages, where)
        full = self.render(msgs, False, where)
        pieces, pos = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = self.render(msgs[:i], True, where)
            stop = self.render(msgs[:i + 1], False, where)
            if not (full.startswith(start) and full.startswith(stop) and len(start) <= len(stop)) or len(start) < pos:
                raise DataError(f"{where}: the chat template {self.name!r} does not render the conversation up to "
                                f"message {i} as a beginning of the whole, so its assistant turns cannot be masked; "
                                "set sft.template to a template that does (ChatML-style templates do).")
            pieces.append((full[pos:len(start)], 0.0, None))
            w = _turn_weight(m)
            pieces.append((full[len(start):len(stop)], w, i if w > 0 else None))
            pos = len(stop)
        pieces.append((full[pos:], 0.0, None))
        enc = [(self.tokenizer.encode(t) if t else np.zeros(0, np.int64), w, mi) for t, w, mi in pieces]
        return _encode_pieces(enc)

    def generation_prompt(self, messages, where: str = "the conversation") -> np.ndarray:
        msgs = check_messages(messages, where)
        return np.asarray(self.tokenizer.encode(self.render(msgs, True, where)), dtype=np.int64)

    def completion(self, ids) -> dict:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        for s in self.stop_ids:
            if s in ids:
                ids = ids[:ids.index(s)]
        return {"role": "assistant", "content": self.tokenizer.decode(ids)}

    def text(self, ids) -> str:
        return self.tokenizer.decode(np.asarray(ids).reshape(-1))


def _hf_message(m: dict) -> dict:
    """Our canonical message in the form HF templates read (OpenAI's tool calls)."""
    out = {k: v for k, v in m.items() if k != "weight"}
    if "tool_calls" in m:
        out["tool_calls"] = [{**({"id": c["id"]} if "id" in c else {}), "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
    return out


ChatTemplate = ByteChatTemplate | JinjaChatTemplate
TEMPLATES = ("auto", "longctx")


def tokenizer_template(tokenizer) -> tuple[str, dict] | None:
    """The chat template a local HF tokenizer ships (chat_template.jinja beside its tokenizer.json, or
    "chat_template" in tokenizer_config.json or tokenizer.json), with its bos/eos token strings."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return None
    folder = Path(path).parent
    special: dict = {}
    cfg_path = folder / "tokenizer_config.json"
    cfg = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            cfg = {}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[k] = v
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), special
    for src in (cfg, _read_json(Path(path))):
        t = src.get("chat_template") if isinstance(src, dict) else None
        if isinstance(t, list):  # several named templates: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if isinstance(t, str) and t.strip():
            return t, special
    return None


def _read_json(p: Path):
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def load_template(spec: str, tokenizer) -> ChatTemplate:
    """sft.template: "auto" (the byte tokenizer's longctx template, or a HF tokenizer's own),
    "longctx" (the byte template; byte tokenizer only) or the path of a .jinja file."""
    is_byte = getattr(tokenizer, "name", None) == "byte"
    if spec == "longctx" or (spec == "auto" and is_byte):
        if not is_byte:
            raise DataError(f"sft.template = \"longctx\" is the byte tokenizer's template, but data.tokenizer is "
                            f"{tokenizer.name!r}; set sft.template = \"auto\" (the tokenizer's own) or a .jinja file.")
        return ByteChatTemplate()
    if spec == "auto":
        found = tokenizer_template(tokenizer)
        if found is None:
            raise DataError(f"data.tokenizer {tokenizer.name!r} carries no chat template (no chat_template.jinja beside "
                            "it and no \"chat_template\" in tokenizer_config.json or tokenizer.json); set sft.template "
                            "to a .jinja file, or use data.tokenizer = \"byte\".")
        return JinjaChatTemplate(found[0], tokenizer, name=f"{tokenizer.name} (its own)", special=found[1])
    p = Path(spec).expanduser()
    if not p.is_file():
        raise DataError(f"sft.template {spec!r} is not auto, longctx or an existing .jinja file; set it to one of those.")
    special = (tokenizer_template(tokenizer) or ("", {}))[1]
    return JinjaChatTemplate(p.read_text(encoding="utf-8"), tokenizer, name=spec, special=special)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__
