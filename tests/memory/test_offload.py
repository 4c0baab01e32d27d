"""Offload of block inputs to host memory (longctx.memory.offload), the logic path on the CPU: CPU tensors
are copied to plain host buffers (force), the previous block is prefetched, the gradients are the plain
step's, and kept buffers are reused across steps and never exceed one step's worth."""

from __future__ import annotations

import pytest

from longctx.memory.offload import Offloader
from longctx.memory.plan import apply_plan
from longctx.memory.recompute import RecomputePolicy
from memory_steps import PLAIN, RECOMPUTE, B, S, _assert_same, _batch, _cfg, _model, _step

pytestmark = pytest.mark.usefixtures("one_thread")


class _CheckedOffloader(Offloader):
    """Asserts the prefetch: once a tensor of block i is back, all of block i-1's are on their way."""

    def unpack(self, h):
        group = getattr(h, "group", None)
        out = super().unpack(h)
        if group is not None:
            pos = self.group_order.index(group)
            if pos > 0:
                for prev in self.groups[self.group_order[pos - 1]]:
                    assert self.handles[prev.index] is None or prev.gpu is not None, "previous block not prefetched"
        return out


@pytest.mark.parametrize("residual,reuse_attention", [("mhc", False), ("attnres", False), ("mhc", True)])
def test_offload_forced_on_cpu(residual, reuse_attention):
    """reuse_attention: the kept attention output and lse go to the host with the block's input and come
    back for its recompute (same gradients, more bytes offloaded)."""
    cfg = _cfg(residual)
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    policy = RecomputePolicy(recompute=True, offload_layers=3, reuse_selection=True, pin_memory=False, force_offload=True,
                             reuse_attention=reuse_attention)
    policy.offloader = off = _CheckedOffloader(pin_memory=False, min_bytes=0, force=True)
    calls = []
    fetch = off._fetch
    off._fetch = lambda h: (calls.append(h.group), fetch(h))[1]

    apply_plan(model, RECOMPUTE)
    model.block_fn = policy
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, return_logits=False)
    # blocks 0..2 offloaded, block 3 kept on the device
    assert off.group_order == [0, 1, 2]
    n = off.live_handles()
    assert n == len(off.handles) >= 3 + 1 + 2 * reuse_attention  # states, layer 1's selection (and o, lse)
    sizes = sorted(h.nbytes for h in off.handles)
    # layers 1 and 2 (DSA, offloaded) hand their fp32 lse (and o) to the host too, and only with the switch
    assert sizes.count(B * S * cfg.attn_heads * 4) == (2 if reuse_attention else 0), sizes
    assert off.bytes_offloaded == off._live_host == sum(h.nbytes for h in off.handles) > 0
    out.loss.backward()
    got = (out.loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
    model.block_fn = None
    _assert_same(ref, got)
    assert off.live_handles() == 0 and off._live_host == 0  # every handle consumed once
    assert calls[0] == 2 and sorted(set(calls)) == [0, 1, 2]  # backward fetched from the last block down
    assert off.peak_host_bytes == off.bytes_offloaded
    policy.end_step()
    assert off.handles == [] and off.groups == {} and off.group_order == []


def _offloading(model, release: bool):
    """Recompute with 3 blocks offloaded into plain host buffers (force: CPU tensors are copied too)."""
    apply_plan(model, RECOMPUTE)
    policy = RecomputePolicy(offload_layers=3, force_offload=True, pin_memory=False, keep_pinned=not release)
    policy.offloader.min_bytes = 0
    model.block_fn = policy
    return policy, policy.offloader


@pytest.mark.parametrize("release", [True, False])
def test_offload_keeps_its_buffers_across_steps_with_keep_pinned(release):
    """keep_pinned: the second step packs into the very buffers of the first (no new
    page-locking, host memory flat), and its gradients are still the plain step's; on (the default),
    nothing is kept between steps."""
    cfg = _cfg()
    model = _model(cfg)
    ids, labels = _batch(cfg)
    ref = _step(model, ids, labels, PLAIN)
    policy, off = _offloading(model, release)
    ptrs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, return_logits=False)
        ptrs.append(sorted(h.host.data_ptr() for h in off.handles))
        out.loss.backward()
        got = (out.loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
        _assert_same(ref, got)
        policy.end_step()
    model.block_fn = None
    kept = sum(b.numel() for bufs in off._pool.values() for b in bufs)
    if release:
        assert kept == 0 and off.kept_bytes == 0
    else:
        assert ptrs[0] == ptrs[1] and kept == off.kept_bytes == off.bytes_offloaded // 2 > 0
    policy.close()
    assert off._pool == {} and off.kept_bytes == 0


def test_kept_buffers_never_exceed_one_steps_worth():
    """keep_pinned with step sizes that change (another sequence length): buffers the step did
    not take are handed back at its end, so the pool is at most the last step's offload, not a union."""
    cfg = _cfg()
    model = _model(cfg)
    policy, off = _offloading(model, release=False)
    per_step = []
    for s in (S, S // 2, S // 2):
        ids, labels = _batch(cfg, s=s)
        before = off.bytes_offloaded
        model.zero_grad(set_to_none=True)
        model(ids, labels=labels, return_logits=False).loss.backward()
        policy.end_step()
        per_step.append(off.bytes_offloaded - before)
        kept = sum(b.numel() for bufs in off._pool.values() for b in bufs)
        assert kept == off.kept_bytes == per_step[-1], (s, kept, off.kept_bytes, per_step)
    model.block_fn = None
    assert per_step[0] > per_step[1] == per_step[2]
    policy.close()


def test_offload_refuses_a_second_backward():
    cfg = _cfg()
    model = _model(cfg)
    ids, labels = _batch(cfg)
    apply_plan(model, RECOMPUTE)
    policy = RecomputePolicy(offload_layers=4, force_offload=True, pin_memory=False)
    policy.offloader.min_bytes = 0
    model.block_fn = policy
    loss = model(ids, labels=labels, return_logits=False).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="unpacked twice"):
        loss.backward()
    policy.end_step()
    model.block_fn = None
