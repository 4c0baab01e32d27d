"""Conversations: the byte chat template (round trip, markers), loss masks, a tokenizer's own Jinja
template, reading .jsonl/.parquet conversations, packing that keeps them apart, and bad data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from longctx.data.chat import (
    ASSISTANT,
    END,
    ByteChatTemplate,
    JinjaChatTemplate,
    check_messages,
    load_template,
    read_conversations,
)
from longctx.data.chat_packing import ChatStream, ConversationList, pack_rows
from longctx.data.tokenizers import ByteTokenizer, load_tokenizer
from longctx.errors import DataError

TPL = ByteChatTemplate()

AGENT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Zürich? ☀"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}, "id": "c1"}]},
    {"role": "tool", "content": "{\"temp\": 21}", "name": "weather", "tool_call_id": "c1"},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "forecast", "arguments": "{\"days\": 1}"}]},
]


def _trained_text(enc, tpl=TPL) -> list[str]:
    return [bytes(enc.tokens[s:e].tolist()).decode("utf-8", errors="replace") for _, s, e in enc.spans]


# ------------------------------------------------------------------------------ the byte template
def test_the_byte_template_round_trips():
    canon = check_messages(AGENT)
    enc = TPL.encode(AGENT)
    assert TPL.decode(enc.tokens) == canon
    # the canonical form: OpenAI's tool call is flattened to name/arguments (+ id); weights are not rendered
    assert canon[2]["tool_calls"] == [{"name": "weather", "arguments": {"city": "Zürich"}, "id": "c1"}]
    assert TPL.decode(TPL.encode([{"role": "user", "content": ""}, {"role": "assistant", "content": "x", "weight": 0}]).tokens) \
        == [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]
    # the markers are bytes UTF-8 text never contains, so no content can forge one
    text_bytes = "".join(m["content"] for m in AGENT).encode("utf-8")
    assert not set(text_bytes) & {0xF5, 0xF6, 0xF7, 0xF8, 0xF9, 0xFA, 0xFB, 0xFC, 0xFE}
    assert TPL.text(enc.tokens).startswith("<|system|>You are terse.<|end|><|user|>What is the weather in Zürich? ☀<|end|>")


def test_generation_prompt_is_the_conversation_so_far_and_the_assistant_byte():
    enc = TPL.encode(AGENT[:5])
    prompt = TPL.generation_prompt(AGENT[:4])
    s = enc.spans[-1][1]
    assert prompt.tolist() == enc.tokens[:s].tolist() and prompt[-1] == ASSISTANT
    assert TPL.completion(enc.tokens[s:]) == {"role": "assistant", "content": "21 °C."}
    # a sampled completion that breaks off or is not UTF-8 still reads as text
    assert TPL.completion(np.array([0xC3, 0x28])) == {"role": "assistant", "content": "\ufffd("}


def test_only_what_the_assistant_wrote_carries_weight():
    enc = TPL.encode(AGENT)
    canon = check_messages(AGENT)
    assert [m for m, _, _ in enc.spans] == [i for i, m in enumerate(canon) if m["role"] == "assistant"]
    trained = _trained_text(enc)
    assert trained[1] == "21 °C.\ufffd"  # the content and the end byte (0xFE, shown as U+FFFD)
    for _, s, e in enc.spans:
        assert enc.tokens[s - 1] == ASSISTANT and enc.tokens[e - 1] == END  # the role byte is prompt, the end trained
    w = np.zeros(len(enc), bool)
    for _, s, e in enc.spans:
        w[s:e] = True
    assert (enc.weights > 0).tolist() == w.tolist()
    lab = enc.labels
    assert (lab[:-1] != -100).tolist() == w[1:].tolist() and lab[-1] == -100
    assert lab[:-1][w[1:]].tolist() == enc.tokens[1:][w[1:]].tolist()
    # an assistant turn with weight 0 is context, not a target
    off = [dict(m) for m in AGENT]
    off[4]["weight"] = 0
    enc0 = TPL.encode(off)
    assert len(enc0.spans) == len(enc.spans) - 1 and enc0.tokens.tolist() == enc.tokens.tolist()


def _position_of(enc, text: str) -> int:
    data = bytes(enc.tokens.tolist())
    at = data.find(text.encode())
    assert at >= 0
    return at


@pytest.mark.parametrize("which, old, new", [(1, "Zürich", "Zurich"), (1, "weather", "wetter"), (3, "21", "35"),
                                             (0, "terse", "tense")])
def test_a_changed_prompt_or_tool_token_changes_no_loss_term(which, old, new):
    """The loss terms are (position, target) pairs of trained tokens. Changing a user, system or tool
    token leaves them as they were: no position predicts a changed token, the trained targets are the
    same tokens in the same order (shifted when the change has another length), every term before the
    change is bitwise the same through the model, and the loss's gradient reaches no logit at a prompt
    or tool position."""
    from longctx.config.model import preset
    from longctx.model import LongCtxModel

    changed = [dict(m) for m in AGENT]
    changed[which]["content"] = changed[which]["content"].replace(old, new)
    a, b = TPL.encode(AGENT), TPL.encode(changed)
    at = _position_of(a, old)
    assert (a.labels[at - 1:at - 1 + len(old.encode())] == -100).all()
    assert a.labels[a.labels != -100].tolist() == b.labels[b.labels != -100].tolist()
    shift = len(new.encode()) - len(old.encode())
    assert [(m, s + shift * (s > at), e + shift * (s > at)) for m, s, e in a.spans] == b.spans
    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny").replace(vocab_size=256)).eval()
    losses = []
    for enc in (a, b):
        x = torch.as_tensor(enc.tokens)[None]
        logits = model(x).logits.detach().requires_grad_(True)
        y = torch.as_tensor(enc.labels)[None]
        tl = torch.nn.functional.cross_entropy(logits[0], y[0], ignore_index=-100, reduction="none")
        tl.sum().backward()
        untrained = y[0] == -100
        assert (tl[untrained] == 0).all() and (logits.grad[0][untrained] == 0).all()
        losses.append(tl.detach())
    assert torch.equal(losses[0][:at - 1], losses[1][:at - 1])


# ------------------------------------------------------------------------------ a tokenizer's own template
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool>"
          "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is the weather in Zurich? Let me look. 21 degrees. And tomorrow?"] * 20, trainer)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return str(d)


def test_a_tokenizers_own_template_masks_the_assistant_turns(hf_tokenizer):
    tok = load_tokenizer(hf_tokenizer)
    tpl = load_template("auto", tok)
    assert isinstance(tpl, JinjaChatTemplate)
    enc = tpl.encode(AGENT)
    trained = [tok.decode(enc.tokens[s:e]) for _, s, e in enc.spans]
    assert trained[1] == "21 °C.<|im_end|>\n"
    assert trained[0].startswith("Let me look.<tool>weather ") and trained[0].endswith("<|im_end|>\n")
    assert tok.decode(enc.tokens) == tpl.render(check_messages(AGENT), False, "")
    prompt = tpl.generation_prompt(AGENT[:4])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    # the rendering is transformers' own
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=hf_tokenizer + "/tokenizer.json", chat_template=CHATML)
    plain = [{"role": m["role"], "content": m["content"]} for m in AGENT]
    assert ref.apply_chat_template(plain, tokenize=False) == tpl.render(check_messages(plain), False, "")


def test_template_choice_is_one_sentence(hf_tokenizer, tmp_path):
    with pytest.raises(DataError, match="byte tokenizer's template"):
        load_template("longctx", load_tokenizer(hf_tokenizer))
    (tmp_path / "tokenizer.json").write_text(open(hf_tokenizer + "/tokenizer.json").read())
    with pytest.raises(DataError, match="carries no chat template"):
        load_template("auto", load_tokenizer(str(tmp_path)))
    with pytest.raises(DataError, match="not auto, longctx or an existing"):
        load_template("nope.jinja", ByteTokenizer())
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(DataError, match="not valid Jinja"):
        load_template(str(bad), ByteTokenizer())
    # a template whose beginnings are not prefixes of the whole cannot be masked
    odd = tmp_path / "odd.jinja"
    odd.write_text("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match="does not render the conversation up to"):
        load_template(str(odd), ByteTokenizer()).encode(AGENT[:5])


# ------------------------------------------------------------------------------ bad data
@pytest.mark.parametrize("msgs, needle", [
    ([{"content": "hi"}], "message 0 has no role; give every message a role (system, user, assistant or tool)."),
    ([{"role": "bot", "content": "hi"}], "unknown role 'bot'; use system, user, assistant or tool."),
    ([{"role": "assitant", "content": "hi"}], "unknown role 'assitant'; did you mean assistant?"),
    ([], "has no messages"),
    ("hello", "has no messages"),
    (["hi"], "message 0 is str, not an object"),
    ([{"role": "user"}], "message 0 (user) has no content"),
    ([{"role": "user", "content": 3}], "content of type int"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages call tools"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"arguments": {}}]}], "tool call 0 has no function name"),
    ([{"role": "assistant", "content": "x", "weight": 0.5}], "weight 0.5; give 0 (not trained on) or 1."),
    ([{"role": "user", "content": "x", "weight": 0}], "only assistant turns are trained on"),
    ([{"role": "user", "content": "x", "contents": "y"}], "unknown field 'contents'; did you mean content?"),
])
def test_bad_messages_are_one_sentence(msgs, needle):
    with pytest.raises(DataError) as e:
        check_messages(msgs, "conversation 7")
    msg = str(e.value)
    assert needle in msg and msg.startswith("conversation 7") and "\n" not in msg


def test_reading_jsonl_and_parquet(tmp_path):
    rows = [{"messages": AGENT[:5]}, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    got = read_conversations(f)
    assert [m for _, m in got] == [check_messages(r["messages"]) for r in rows]
    assert got[1][0].endswith("line 2")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    simple = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}] * 3
    pq.write_table(pa.Table.from_pylist(simple), tmp_path / "c.parquet")
    assert [m for _, m in read_conversations(tmp_path / "c.parquet")] == [check_messages(r["messages"]) for r in simple]
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [{"content": 1}]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl' line 2, message 0 has no role"):
        read_conversations(tmp_path / "bad.jsonl")
    (tmp_path / "nofield.jsonl").write_text('{"conversation": []}\n')
    with pytest.raises(DataError, match="has no 'messages' field .*set sft.messages_field"):
        read_conversations(tmp_path / "nofield.jsonl")
    (tmp_path / "junk.jsonl").write_text('{"messages": \n')
    with pytest.raises(DataError, match="line 1 is not JSON"):
        read_conversations(tmp_path / "junk.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_conversations(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------ packing
def _convs(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = " ".join("ab cd efg" for _ in range(int(rng.integers(1, 12))))
        out.append(TPL.encode([{"role": "user", "content": f"q{i} {words}"}, {"role": "assistant", "content": f"a{i}"}]))
    return out


def test_packing_keeps_conversations_whole_and_apart():
    convs = _convs(30)
    stream = ChatStream(ConversationList(convs, seed=3), seq_len=128, batch_size=2)
    seen = []
    for _ in range(6):
        b = stream.next_batch()
        cu = b.cu_seqlens().tolist()
        flat_x, flat_y = b.inputs.reshape(-1), b.labels.reshape(-1)
        for a, e in zip(cu[:-1], cu[1:]):
            seg = flat_x[a:e].tolist()
            match = [c for c in convs if c.tokens.tolist() == seg]
            if match:  # a whole conversation, its own labels
                assert flat_y[a:e].tolist() == match[0].labels.tolist()
                seen.append(seg)
            else:  # the padding at a row's end: no loss
                assert set(seg) == {0} and (flat_y[a:e] == -100).all()
        assert all(r * 128 in cu for r in range(3))  # each row starts a document
    src = ConversationList(convs, seed=3)
    assert seen == [src.get(k, 128).tokens.tolist() for k in range(len(seen))]  # in order, none skipped
    assert len(seen) > 12  # more conversations than rows: rows hold several


def test_the_stream_resumes_exactly_and_follows_the_stage_length():
    src = ConversationList(_convs(40), seed=1)
    a = ChatStream(src, seq_len=128, batch_size=3)
    for _ in range(4):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # as a checkpoint holds it
    b = ChatStream(ConversationList(_convs(40), seed=1), seq_len=128, batch_size=3)
    b.load_state_dict(state)
    for _ in range(3):
        assert all(torch.equal(x, y) for x, y in zip(a.next_batch(), b.next_batch()))
    a.set_window(200, 1)
    b.set_window(200, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.next_batch(), b.next_batch()))
    with pytest.raises(DataError, match="other conversations"):
        ChatStream(ConversationList(_convs(41), seed=1), 128).load_state_dict(state)


def test_a_conversation_longer_than_the_stage_is_one_sentence():
    src = ConversationList(_convs(5), seed=0, names=[f"data.path 'c.jsonl' line {i + 1}" for i in range(5)])
    longest = max(len(c) for c in src.convs)
    with pytest.raises(DataError) as e:
        src.check_fits(longest - 1, "stages.0.seq_len")
    assert "stages.0.seq_len = " in str(e.value) and "conversations are never cut" in str(e.value)
    with pytest.raises(DataError, match="does not fit a row"):
        pack_rows(src.convs, longest - 1)
