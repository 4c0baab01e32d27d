"""longctx.measure.peak: the replay of an allocator trace finds the peak and what was alive then."""

from __future__ import annotations

from longctx.measure.peak import alive_at_peak, format_peak


def _f(file, line, name="f"):
    return [{"filename": "/usr/lib/python3/site-packages/torch/x.py", "line": 1, "name": "inner"},
            {"filename": f"/src/longctx/{file}", "line": line, "name": name}]


def test_peak_and_sites_from_a_trace():
    ev = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _f("layers/kda.py", 10)},
        {"action": "alloc", "addr": 2, "size": 300, "frames": _f("layers/moe.py", 20)},
        {"action": "free_requested", "addr": 2, "size": 300},  # not yet free: the stream may still use it
        {"action": "alloc", "addr": 3, "size": 50, "frames": _f("layers/kda.py", 10)},  # peak: 1000+100+300+50
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 4, "size": 200, "frames": []},
        {"action": "free_completed", "addr": 99, "size": 400},  # allocated before recording
        {"action": "alloc", "addr": 5, "size": 10, "frames": _f("model.py", 5)},
    ]
    r = alive_at_peak(ev, before=1000)
    assert r["peak_bytes"] == 1450 and r["at_event"] == 3 and r["untracked_bytes"] == 1000
    assert r["by_site"] == [("layers/moe.py:20 f", 300, 1), ("layers/kda.py:10 f", 150, 2)]
    text = format_peak(r)
    assert "layers/moe.py:20" in text and "allocated before recording" in text


def test_top_sites_and_the_rest():
    ev = [{"action": "alloc", "addr": i, "size": 10 * (i + 1), "frames": _f("a.py", i)} for i in range(5)]
    r = alive_at_peak(ev, top=2)
    assert [b for _, b, _ in r["by_site"]] == [50, 40] and r["other_bytes"] == 60
    assert "(other sites)" in format_peak(r)


def test_locate_peak_names_the_marks_around_it():
    from longctx.measure.peak import format_timeline, locate_peak

    marks = [("fwd start a", 10, 10), ("fwd end a", 30, 40), ("bwd start a", 20, 40), ("bwd end a", 25, 90),
             ("bwd end b", 5, 90)]
    r = locate_peak(marks)
    assert (r["peak_bytes"], r["index"], r["after"], r["by"]) == (90, 3, "bwd start a", "bwd end a")
    assert (r["allocated_after"], r["allocated_by"]) == (20, 25)
    assert "reached after 'bwd start a' and by 'bwd end a'" in format_timeline(marks)
    assert locate_peak([])["index"] is None


def _tiny_step(recompute: bool, timeline_on: bool):
    import contextlib

    import torch

    from longctx.config import preset
    from longctx.measure.peak import timeline
    from longctx.memory.plan import MemoryPlan, apply_plan
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny"))
    apply_plan(model, MemoryPlan(recompute="on" if recompute else "off", offload="off", seq_chunk="off"))
    ids = torch.randint(0, model.cfg.vocab_size, (1, 65))
    count = [0]

    def read():  # a fake allocator: every read is one more byte, the maximum follows
        count[0] += 1
        return count[0], count[0]

    ctx = timeline(model, read=read) if timeline_on else contextlib.nullcontext([])
    with ctx as marks:
        model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
    return marks, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_timeline_marks_forward_recompute_and_backward_without_changing_gradients():
    import torch

    for recompute in (False, True):
        marks, grads = _tiny_step(recompute, True)
        _, plain = _tiny_step(recompute, False)
        assert grads.keys() == plain.keys() and all(torch.equal(grads[n], plain[n]) for n in grads)
        labels = [m[0] for m in marks]
        last = f"layers.{len(set(lbl.split()[-1].split('.')[1] for lbl in labels)) - 1}"
        for want in ("fwd start layers.0", "fwd end layers.0.mixer", "bwd start layers.0.mlp", "bwd end layers.0.mixer",
                     f"bwd start {last}"):
            assert want in labels, (recompute, want)
        assert ("recompute start layers.0.mixer" in labels) == recompute
        # backward runs last block first: its gradient arrives before the first block's
        assert labels.index(f"bwd start {last}") < labels.index("bwd start layers.0")


def _metered_step(model, ids, with_timeline: bool, chunk: int = 0):
    """One step under LiveBytes (a CPU allocator twin); with the timeline its counter restarts at every
    mark, as torch.cuda's does on the GPU. Returns (overall peak, marks)."""
    from longctx.measure.meter import LiveBytes
    from longctx.measure.peak import timeline
    from longctx.memory.sequence_chunks import SequenceChunker

    with LiveBytes() as live:
        def read():
            return live.current, live.peak

        def reset():
            live.peak = live.current

        ctx = timeline(model, read=read, reset=reset) if with_timeline else None
        marks = ctx.__enter__() if ctx else None
        try:
            if chunk:
                chunker = SequenceChunker(chunk)
                chunker.progress = marks.mark if marks is not None else None
                chunker.forward_backward(model, ids[:, :-1], ids[:, 1:])
            else:
                model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
            if marks is not None:
                marks.mark("after the step")
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        for p in model.parameters():
            p.grad = None
        return (marks[-1][2] if marks else live.peak), marks


def test_phase_peaks_split_the_step_and_their_maximum_is_the_step_peak():
    """Per-interval marks: each phase of the step (the forward, each block's backward; each chunk of a
    sequence-chunked step) gets its own peak, and the largest is the whole step's peak."""
    import torch

    from longctx.config import preset
    from longctx.measure.peak import phase_peaks
    from longctx.memory.plan import MemoryPlan, apply_plan
    from longctx.model import LongCtxModel

    torch.manual_seed(0)
    model = LongCtxModel(preset("tiny"))
    kinds = model.cfg.layer_kinds()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 129))
    apply_plan(model, MemoryPlan(recompute="on", offload="off", seq_chunk="off"))
    plain, _ = _metered_step(model, ids, False)
    peak, marks = _metered_step(model, ids, True)
    phases = phase_peaks(marks, kinds)
    assert peak == plain and max(phases.values()) == plain
    assert list(phases)[0] == "the forward and the loss"
    assert {f"the backward of layer {i} ({k})" for i, k in enumerate(kinds)} <= set(phases)
    assert len({v for n, v in phases.items() if "backward" in n}) > 1  # not one running max repeated

    # sequence chunks: the forward sweep, then each chunk of the backward sweep, last first
    plain, _ = _metered_step(model, ids, False, chunk=64)
    peak, marks = _metered_step(model, ids, True, chunk=64)
    phases = phase_peaks(marks, kinds)
    assert peak == plain and max(phases.values()) == plain
    assert "the forward sweep" in phases
    for c in ("2/2", "1/2"):
        assert f"chunk {c}: the backward of layer {len(kinds) - 1} ({kinds[-1]})" in phases, list(phases)
