"""SFT as a job: packed conversations equal separate ones through the model (fp32), `longctx sft` on
conversations from a file and on the embedded task (evaluation, accuracy by length, resume), and bad
data as one sentence with exit code 2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from longctx.cli import main
from longctx.config.model import preset
from longctx.data.chat import ByteChatTemplate
from longctx.data.chat_packing import pack_rows
from longctx.errors import ConfigError
from longctx.model import LongCtxModel
from longctx.train import sft as sft_mod

pytestmark = pytest.mark.usefixtures("one_thread")
TPL = ByteChatTemplate()


def _conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta def class return yield lambda".split()
    out = []
    for i in range(n):
        q = " ".join(rng.choice(words, int(rng.integers(3, 30))))
        a = " ".join(rng.choice(words, int(rng.integers(1, 6))))
        msgs = [{"role": "user", "content": f"{i}: {q}?"}, {"role": "assistant", "content": a}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "more"},
                     {"role": "assistant", "content": "", "tool_calls": [{"name": "look", "arguments": {"q": q[:9]}}]},
                     {"role": "tool", "content": q[::-1]}, {"role": "assistant", "content": a.upper()}]
        out.append(msgs)
    return out


# ------------------------------------------------------------------------------ packed == separate
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_packed_conversations_equal_separate_ones(name):
    """Rows packed as the SFT stream packs them, flattened into one row with the conversations'
    cu_seqlens (as the trainer's step does), give every conversation the token losses and the
    gradient it has alone: KDA restarts its state, DSA runs its indexer per document (tiny: top-8 of
    4-token pools, so the attention really is sparse), the MoE and mHC are per token. fp32: the losses
    to 1e-6, the gradients (sums over every token, in another order) to fp32 rounding."""
    torch.manual_seed(0)
    cfg = preset(name).replace(vocab_size=256, indexer_loss=False)
    model = LongCtxModel(cfg).eval()
    convs = [TPL.encode(m) for m in _conversations(7 if name == "tiny" else 4)]
    batch = pack_rows(convs, seq_len=max(len(c) for c in convs) + 40)
    assert batch.inputs.shape[0] < len(convs)  # some rows hold several conversations
    x, y, cu = sft_mod.model_inputs(batch, lambda t: t, None, None)
    tl = model.chunked_token_losses(model.hidden(x, cu_seqlens=cu), y)
    tl.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    packed = tl[0].detach()
    out = model(x, labels=y, cu_seqlens=cu, return_logits=False, token_losses=True)  # the trainer's call
    assert torch.equal(out.token_losses[0], packed)
    starts = cu.tolist()
    total = 0
    for c in convs:
        xi, yi = torch.as_tensor(c.tokens)[None], torch.as_tensor(c.labels)[None]
        alone = model.chunked_token_losses(model.hidden(xi), yi)
        alone.sum().backward()
        at = next(a for a in starts if x[0, a:a + len(c)].tolist() == c.tokens.tolist())
        torch.testing.assert_close(packed[at:at + len(c)], alone[0].detach(), rtol=1e-6, atol=1e-6)
        total += int((yi != -100).sum())
    assert total == int((y != -100).sum())  # every trained token is some conversation's
    for n, p in model.named_parameters():  # sums over all tokens in another order: fp32 rounding of the largest entry
        if p.grad is not None:
            assert (packed_grads[n] - p.grad).abs().max() <= 1e-4 * p.grad.abs().max() + 1e-9, n


def test_the_indexer_kl_of_packed_conversations_is_their_own():
    """The indexer's KL of a packed row is the mean over its conversations' queries of what each has
    alone: dense (the warm-up) or sparse by the conversation's own length, not the packed row's.
    Conversations of one length fill rows of that length, so the packed KL is the plain mean."""
    torch.manual_seed(0)
    words = "alpha beta gamma delta "
    convs = [TPL.encode([{"role": "user", "content": (words[5 * i:] + words[:5 * i]) * 3},
                         {"role": "assistant", "content": "delta"}]) for i in range(3)]
    L = len(convs[0])
    assert all(len(c) == L for c in convs) and L > 2 * 8  # longer than tiny's top-8 selection: dense != sparse
    cfg = preset("tiny").replace(vocab_size=256, indexer_loss=True, indexer_loss_dense_below=L)
    model = LongCtxModel(cfg).train()
    batch = pack_rows(convs, seq_len=L)
    x, y, cu = sft_mod.model_inputs(batch, lambda t: t, None, None)
    assert x.shape[1] == 3 * L > cfg.indexer_loss_dense_below
    with torch.no_grad():
        model(x, labels=y, cu_seqlens=cu, return_logits=False)
        packed = model.aux_losses()["indexer_kl"]
        alone = []
        for c in convs:
            model(torch.as_tensor(c.tokens)[None], labels=torch.as_tensor(c.labels)[None], return_logits=False)
            alone.append(model.aux_losses()["indexer_kl"])
    torch.testing.assert_close(packed, torch.stack(alone).mean(), rtol=1e-5, atol=1e-7)


def test_unpacked_rows_need_no_boundaries_and_docs_reach_dsa():
    from longctx.layers.dsa import SparseMLA, document_spans

    assert document_spans(torch.tensor([0, 3, 10]), 2, 5) == [(0, 0, 3), (0, 3, 5), (1, 0, 5)]
    cfg = preset("tiny").replace(vocab_size=256)
    layer = next(b.mixer for b in LongCtxModel(cfg).layers if isinstance(b.mixer, SparseMLA))
    with pytest.raises(ValueError, match="packed documents"):
        layer(torch.zeros(1, 8, cfg.hidden_size), cache=layer.init_cache(), cu_seqlens=torch.tensor([0, 8]))


def test_sft_refuses_what_does_not_keep_conversations_apart():
    class Chunked:
        def forward_backward(self):
            pass

    batch = pack_rows([TPL.encode(m) for m in _conversations(2)], 1024)
    with pytest.raises(ConfigError, match="memory.seq_chunk = 0"):
        sft_mod.model_inputs(batch, lambda t: t, None, Chunked())
    cfg = type("C", (), {"parallel": type("P", (), {"cp": 2})()})()
    with pytest.raises(ConfigError, match="parallel.cp = 1"):
        sft_mod.check_parallel(cfg, world=2)


# ------------------------------------------------------------------------------ the job
TINY = ["--preset", "tiny", "--set", "stages.0.seq_len=512", "--set", "stages.0.steps=3", "--set", "stages.0.batch_size=2",
        "--set", "stages.0.warmup=0", "--set", "stages.1.seq_len=1024", "--set", "stages.1.steps=2",
        "--set", "stages.1.batch_size=1", "--set", "stages.1.warmup=0", "--set", "data.eval_docs=4", "--quiet"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    f = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    f.write_text("\n".join(json.dumps({"messages": m}) for m in _conversations(40)) + "\n")
    return str(f)


def test_sft_on_conversations_from_a_file_and_resume(chats, tmp_path):
    run = str(tmp_path / "a")
    assert main(["sft", *TINY, "--set", f"data.path={chats}", "--out", run]) == 0
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["after"]["turns"] >= 4 and 0 <= summary["after"]["accuracy"]["all"] <= 1
    assert summary["before"]["loss"] > summary["after"]["loss"]
    assert "exact match" in summary["accuracy_table"]
    for f in ("loss.png", "per_position_loss.png", "accuracy.png"):
        assert os.path.exists(os.path.join(run, f))
    recs = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert json.load(open(os.path.join(run, "config.json")))["task"] == "sft"
    steps = [r for r in recs if "loss" in r]
    assert [r["seq_len"] for r in steps] == [512] * 3 + [1024] * 2
    # stopped after 2 steps and resumed: the same losses as the run that did not stop
    run2 = str(tmp_path / "b")
    assert main(["sft", *TINY, "--set", f"data.path={chats}", "--out", run2, "--max-steps", "2"]) == 0
    assert main(["sft", *TINY, "--set", f"data.path={chats}", "--out", run2, "--resume"]) == 0
    again = [json.loads(x) for x in open(os.path.join(run2, "metrics.jsonl"))]
    assert [r["loss"] for r in again if "loss" in r] == pytest.approx([r["loss"] for r in steps], rel=1e-6)


def test_sft_on_the_embedded_task(tmp_path, monkeypatch):
    from longctx.data import retrieval_task
    from test_retrieval_task import PACKAGES

    real = retrieval_task.stdlib_files
    monkeypatch.setattr(retrieval_task, "stdlib_files", lambda: real(packages=PACKAGES))
    run = str(tmp_path / "task")
    args = ["--preset", "tiny", "--set", "stages=[{seq_len = 1024, steps = 2, lr = 1e-3}]", "--set", "sft.questions=2",
            "--set", "sft.eval_lengths=[1024, 2048]", "--set", "sft.eval_examples=2", "--out", run, "--quiet"]
    assert main(["train", "--set", "task=sft", *args]) == 0
    s = json.load(open(os.path.join(run, "summary.json")))
    assert list(s["after"]["accuracy"]) == ["1024", "2048"] and s["after"]["turns"] == 8
    assert [b["end"] for b in s["after"]["buckets"]] == [1024, 2048]
    assert set(s["after"]["by_kind"]) <= {"signature", "returns", "file"}
    assert s["table"] and "kind" in s["accuracy_table"]


# ------------------------------------------------------------------------------ bad data: one sentence, exit 2
@pytest.mark.parametrize("rows, needle", [
    ([[{"content": "hi"}, {"role": "assistant", "content": "x"}]], "line 1, message 0 has no role; give every message a role"),
    ([[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      [{"role": "robot", "content": "hi"}]], "line 2, message 0 has the unknown role 'robot'; use system, user, assistant or tool."),
    ([[{"role": "user", "content": "x" * 1100}, {"role": "assistant", "content": "b"}]],
     "line 1 has 1105 tokens, more than stages.0.seq_len = 512; raise stages.0.seq_len"),
    ([[{"role": "user", "content": "a"}]], "has no assistant turn to train on"),
])
def test_bad_data_is_one_sentence_and_exit_2(tmp_path, capsys, rows, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(json.dumps({"messages": m}) for m in rows) + "\n")
    assert main(["sft", *TINY, "--set", f"data.path={f}", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err and "Traceback" not in err


def test_bad_sft_settings_are_one_sentence(tmp_path, capsys):
    for sets, needle in [(["sft.kinds=[\"size\"]"], "sft.kinds has the unknown kind 'size'"),
                         (["sft.eval_lengths=[12]"], "sft.eval_lengths has 12"),
                         (["sft.questions=0"], "sft.questions must be >= 1"),
                         (["task=rlhf"], "task must be one of pretrain, sft, rl"),
                         (["sft.template=longctx", "data.tokenizer=byte", "sft.colour=1"], "unknown setting sft.colour")]:
        argv = ["sft", "--print-config"] + [x for s in sets for x in ("--set", s)]
        if sets == ["task=rlhf"]:
            argv = ["train", "--print-config", "--set", "task=rlhf"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def test_held_out_conversations_do_not_depend_on_the_files_place_or_order(tmp_path):
    """The held-out set is picked by what each conversation says: the same lines in another folder,
    or in another order, hold out the same conversations."""
    from longctx.config.loading import load_train_config
    from longctx.data.tokenizers import load_tokenizer

    convs = _conversations(40)
    held = []
    for folder, order in (("a", convs), ("b/c", convs), ("d", convs[::-1])):
        f = tmp_path / folder / "chats.jsonl"
        f.parent.mkdir(parents=True)
        f.write_text("\n".join(json.dumps({"messages": m}) for m in order) + "\n")
        cfg = load_train_config(preset="tiny", sets=["task=sft", f"data.path={f}", "data.eval_docs=4"])
        data = sft_mod.SFTData(cfg, load_tokenizer(cfg.data.tokenizer), quiet=True)
        held.append(sorted(c.tokens.tobytes() for c in data.eval_convs))
        assert len(held[-1]) == 4 and data.n_conversations == 36
    assert held[0] == held[1] == held[2]
