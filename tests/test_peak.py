"""longctx.memory.peak: the replay of an allocator trace finds the peak and what was alive then."""

from __future__ import annotations

from longctx.memory.peak import alive_at_peak, format_peak


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
