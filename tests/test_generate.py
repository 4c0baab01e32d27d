"""The batched sampler (`generate.sample`): greedy in the limit of temperature, the top-p nucleus, stop
ids and stop strings, rows leaving the batch, and log-probs equal to the training forward's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from longctx.config import preset
from longctx.data.tokenizers import ByteTokenizer
from longctx.generate import filter_logits, generate, sample
from longctx.model import LongCtxModel

pytestmark = pytest.mark.usefixtures("one_thread")
DECODE = ByteTokenizer().decode


def _model():
    torch.manual_seed(0)
    # no exact ties in any top-k (see test_trainer's decode test): init_std 0.2, 16 indexer heads
    return LongCtxModel(preset("tiny").replace(init_std=0.2, index_heads=16)).eval()


class _Count:
    """A scripted model's decoding state: tokens emitted so far and the row's first token, batch-first."""

    def __init__(self, batch):
        self.n = torch.zeros(batch, dtype=torch.long)
        self.first = torch.full((batch,), -1, dtype=torch.long)


class Scripted(nn.Module):
    """Draws its first token uniformly from the keys of `scripts`, then writes the script that token
    starts (logits 40 on the next byte, 0 elsewhere: another byte has probability ~1e-15). Rows of a
    batch so follow different scripts of different lengths, which only stays right if the sampler
    keeps each row's state with its row as rows finish and leave the batch."""

    def __init__(self, scripts: dict[str, str]):
        super().__init__()
        self.embed = nn.Embedding(1, 1)
        self.scripts = {ord(k): (k + v).encode() for k, v in scripts.items()}

    def init_caches(self, batch, device=None, dtype=None):
        return [_Count(batch)]

    def hidden(self, ids, caches=None):
        return torch.zeros(ids.shape[0], ids.shape[1], 1)  # the prefill: the state stays at 0 tokens

    def lm_head(self, h, caches=None, last=None):
        logits = torch.zeros(h.shape[0], 256)
        if caches is None:  # the first token: uniform over the scripts' first bytes
            logits[:] = -40.0
            logits[:, list(self.scripts)] = 0.0
            return logits
        c = caches[0]
        for row in range(h.shape[0]):
            script = self.scripts[int(c.first[row])]
            logits[row, script[min(int(c.n[row]), len(script) - 1)]] = 40.0
        return logits

    def forward(self, ids, caches=None):
        c = caches[0]
        c.first = torch.where(c.first < 0, ids[:, 0], c.first)
        c.n = c.n + 1
        return SimpleNamespace(logits=self.lm_head(torch.zeros(ids.shape[0], 1), caches)[:, None])


def test_temperature_to_zero_is_greedy():
    m = _model()
    p = torch.randint(0, m.cfg.vocab_size, (40,))
    greedy = generate(m, p[None], 25, temperature=0)[0, 40:].tolist()
    for temp in (0.0, 1e-6):
        got = sample(m, [p, p[:30]], n=3, max_new_tokens=25, temperature=temp, seed=1)
        assert all(c.tokens == greedy and c.finish == "length" for c in got[0]), temp
        assert len({tuple(c.tokens) for c in got[1]}) == 1  # every row of a greedy group alike


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: ids 1, 3, 2, 0
    logits = probs.log()[None]
    for p, kept in [(0.4, {1}), (0.79, {1, 3}), (0.81, {1, 3, 2}), (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})]:
        lg = filter_logits(logits, 1.0, top_p=p)
        assert set(torch.nonzero(lg[0].isfinite()).flatten().tolist()) == kept, p
        torch.testing.assert_close(torch.softmax(lg, -1)[0, sorted(kept)],
                                   (probs[sorted(kept)] / probs[sorted(kept)].sum()).double())
    # with top-k first, then the nucleus of what is left; and draws stay inside the set
    lg = filter_logits(logits, 1.0, top_k=2, top_p=0.6)  # top-2 renormalised: 0.625, 0.375 -> only id 1 needed
    assert torch.nonzero(lg[0].isfinite()).flatten().tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.softmax(filter_logits(logits.expand(2000, -1), 1.0, top_p=0.79), -1), 1, generator=g)
    assert set(draws.flatten().tolist()) == {1, 3}


def test_stop_ids_stop_strings_and_rows_that_leave_the_batch():
    m = Scripted({"a": "bc;", "x": "yz1234567890", "q": "rs STOP tuv;"})
    groups = sample(m, [torch.tensor([1, 2, 3])], n=12, max_new_tokens=9, temperature=1.0, stop_ids=[ord(";")],
                    stop_strings=["STOP", "S T"], decode=DECODE, seed=3)
    seen = set()
    for c in groups[0]:
        text = bytes(c.tokens).decode()
        seen.add(text[0])
        if text[0] == "a":  # the stop id ends it, and is kept as the last token; the text leaves it out
            assert (text, c.finish, c.text) == ("abc;", "stop", "abc")
        elif text[0] == "x":  # no stop: max_new_tokens
            assert (text, c.finish, c.text) == ("xyz123456", "length", "xyz123456")
        else:  # the tokens run up to the one that completes the stop string; the text ends before it
            assert (text, c.finish, c.text) == ("qrs STOP", "stop_string", "qrs ")
        assert len(c.logprobs) == len(c.tokens) and all(lp <= 0 for lp in c.logprobs)
    assert seen == {"a", "x", "q"}  # the rows really took different scripts of different lengths


def test_sampled_logprobs_equal_the_training_forward():
    """fp32: a group sampled through the caches (prefill once, rows copied, finished rows dropped) has,
    token by token, the log-probs a training forward over prompt + completion gives."""
    m = _model()
    p = torch.randint(0, m.cfg.vocab_size, (3 * m.cfg.index_topk + 5,))  # longer than top-k: DSA really sparse
    groups = sample(m, [p], n=4, max_new_tokens=20, temperature=1.0, stop_ids=[5, 7, 9, 11, 13], seed=0)
    assert len({len(c.tokens) for c in groups[0]}) > 1  # rows left the batch at different steps
    for c in groups[0]:
        ids = torch.cat([p, torch.tensor(c.tokens)])[None]
        with torch.no_grad():
            full = torch.log_softmax(m(ids).logits.float(), -1)[0, len(p) - 1:-1].gather(-1, ids[0, len(p):, None])
        assert (full.squeeze(-1) - torch.tensor(c.logprobs)).abs().max() < 1e-5


def test_a_seed_reproduces_the_draws():
    m = _model()
    p = torch.randint(0, m.cfg.vocab_size, (30,))
    a, b, c = (sample(m, [p], n=3, max_new_tokens=12, seed=s) for s in (5, 5, 6))
    assert [x.tokens for x in a[0]] == [x.tokens for x in b[0]] != [x.tokens for x in c[0]]
