"""`longctx estimate --gpus G [--cp K] [--ep E]` and `--fit`: one GPU prints what the single-process
estimate prints, the CP it picks is named, the fit search reports the smallest cluster it found (and that
the one before it does not fit), and a wrong --gpus / --cp / --ep is one sentence and exit 2."""

from __future__ import annotations

import json

import pytest

from longctx.cli import main


def _run(capsys, *argv):
    rc = main(["estimate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_one_gpu_prints_todays_estimate(capsys):
    for argv in (["--preset", "tiny", "--seq-len", "4096"], ["--preset", "h200-ref", "--seq-len", "262144"]):
        rc0, today, _ = _run(capsys, *argv)
        rc1, one, _ = _run(capsys, *argv, "--gpus", "1", "--cp", "1")
        assert rc0 == rc1 and one == today
        rc2, js, _ = _run(capsys, *argv, "--gpus", "1", "--json")
        e = json.loads(js)
        assert rc2 == rc0 and e["cp"] == 1 and e["cluster"]["gpus"] == 1
        assert f"{e['gpu_bytes'] / 2**30:9.2f}" in today


def test_gpus_prints_the_per_gpu_breakdown_and_the_cp_it_picks(capsys):
    # whole sequences (cp 1 would fit by chunking them)
    rc, out, _ = _run(capsys, "--preset", "h200-ref", "--seq-len", "65536", "--gpus", "4", "--gpu", "cpu",
                      "--set", "seq_chunk=off")
    assert rc == 0, out
    assert "per GPU of 4 GPUs = dp 2 x cp 2" in out and "cp 2: the smallest of 1, 2, 4 whose plan fits" in out
    for word in ("FSDP gathered root", "FSDP gathered block parameters", "CP exchange buffers", "dominant term:"):
        assert word in out, word
    rc, js, _ = _run(capsys, "--preset", "h200-ref", "--seq-len", "65536", "--gpus", "4", "--cp", "4", "--ep", "4",
                     "--gpu", "cpu", "--json")
    e = json.loads(js)
    assert e["cp"] == 4 and e["cluster"]["ep"] == 4 and e["dominant_term"]


def test_fit_names_the_smallest_cluster(capsys):
    rc, out, _ = _run(capsys, "--preset", "glm-5.3-flash", "--seq-len", "65536", "--fit", "--json")
    r = json.loads(out)
    assert rc == 0 and r["gpus"] and r["found"]["fits"] and r["found"]["estimate"]["fits"]
    sizes = [t["gpus"] for t in r["tried"]]
    assert sizes[-1] == r["gpus"] and all(not t["fits"] for t in r["tried"][:-1]) and sizes[0] == 8
    rc, text, _ = _run(capsys, "--preset", "glm-5.3-flash", "--seq-len", "65536", "--fit")
    assert rc == 0 and f"smallest cluster: {r['gpus']} GPUs" in text and "dominant term" in text


@pytest.mark.parametrize("argv,needle", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "8", "--cp", "3"], "--cp 3 does not divide --gpus 8"),
    (["--gpus", "8", "--ep", "5"], "--ep 5 does not divide the 288 routed experts"),
    (["--gpus", "8", "--ep", "16"], "--ep 16 does not divide --gpus 8"),
    (["--gpus", "8", "--ep", "0"], "--ep"),
    (["--seq-len", "6144", "--gpus", "6", "--cp", "3"], "--cp 3 does not divide the 64 KDA heads"),
    (["--seq-len", "4100", "--gpus", "8", "--cp", "8"], "--seq-len 4100"),
    (["--ep", "2"], "--ep describes a step over several GPUs"),
    (["--fit", "--gpus", "8"], "--fit"),
    (["--gpus", "8", "--kda-cp", "ulysses"], "--kda-cp"),
])
def test_bad_gpus_cp_ep_are_one_sentence_and_exit_2(argv, needle, capsys):
    rc, out, err = _run(capsys, "--preset", "glm-5.3-flash", "--seq-len", "4096", *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], (rc, err)
