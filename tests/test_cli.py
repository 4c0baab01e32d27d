"""The subcommands' arguments: a mistake is one `error: ...` sentence and exit 2, never a traceback;
data.eval_windows=0 turns evaluation off; every preset the CLI lists trains on the default data."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longctx.cli import main
from longctx.config.loading import load_train_config
from longctx.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# Two steps of the tiny model at a tiny length on the embedded corpus.
TWO_STEPS = ["preset=tiny", "model.vocab_size=256", "stages=[{seq_len = 32, steps = 2, lr = 1e-3}]", "log_every=1000"]


# ------------------------------------------------------------------------------ data.eval_windows=0
def test_eval_windows_zero_trains_without_evaluation(tmp_path):
    logged = []
    tr = Trainer(load_train_config(None, None, [*TWO_STEPS, "data.eval_windows=0", "eval_every=1"]),
                 out_dir=str(tmp_path), log=logged.append)
    summary = tr.run()
    assert summary["step"] == 2 and summary["before"] is None and summary["after"] is None
    assert not any("held-out loss" in line for line in logged), logged
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(recs) == 2 and not any("eval" in r or "eval_loss" in r for r in recs), recs
    assert not os.path.exists(tmp_path / "per_position_loss.png")
    assert os.path.exists(tmp_path / "loss.png") and os.path.exists(tmp_path / "checkpoint")
    assert json.loads((tmp_path / "summary.json").read_text())["after"] is None


def test_eval_windows_zero_from_the_cli(tmp_path, capsys):
    sets = [a for s in [*TWO_STEPS, "data.eval_windows=0"] for a in ("--set", s)]
    assert main(["train", *sets, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" not in out and "checkpoint (final)" in out, out


# ------------------------------------------------------------------------------ one sentence per bad argument
@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    """A one-step tiny run (the checkpoint eval/generate/export read), one whose model has more ids than
    the byte tokenizer, a small held-out folder for eval --data, and tokenizer.json files of 50 and 300 ids."""
    from tokenizers import Tokenizer, models

    root = tmp_path_factory.mktemp("cli")
    base = ["preset=tiny", "stages=[{seq_len = 32, steps = 1, lr = 1e-3}]", "data.eval_windows=1", "log_every=1000"]
    Trainer(load_train_config(None, None, base), out_dir=str(root / "run"), quiet=True).run()
    Trainer(load_train_config(None, None, [*base, "model.vocab_size=300"]), out_dir=str(root / "run300"), quiet=True).run()
    data = root / "data"
    data.mkdir()
    for i in range(3):
        (data / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + 1  # a small held-out document\n" * 2)
    for n in (50, 300):
        words = {f"w{i}": i for i in range(n - 1)} | {"[UNK]": n - 1}
        Tokenizer(models.WordLevel(words, unk_token="[UNK]")).save(str(root / f"tok{n}.json"))
    return {"CK": str(root / "run"), "CK300": str(root / "run300"), "DATA": str(data), "TOK50": str(root / "tok50.json"),
            "TOK300": str(root / "tok300.json"), "ROOT": str(root)}


def _fill(args, dirs):
    return [dirs.get(a, a) for a in args]


def _one_error(capsys, argv, *needles) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, (argv, rc, err[-2000:])
    assert "Traceback" not in err and "\n" not in err and err.startswith("error: "), err
    for n in needles:
        assert n in err, (argv, err)
    return err


EVAL = ["eval", "--checkpoint", "CK", "--data", "DATA", "--seq-len", "16", "--windows", "1", "--buckets", "4"]
GEN = ["generate", "--checkpoint", "CK", "--prompt", "def ", "--max-new-tokens", "4"]
TRAIN = ["train", "--preset", "tiny", "--print-config"]
BAD_ARGS = [
    (EVAL + ["--seq-len", "0"], "--seq-len must be >= 1 (got 0)"),
    (EVAL + ["--seq-len", "-1"], "--seq-len must be >= 1 (got -1)"),
    (EVAL + ["--seq-len", "abc"], "--seq-len must be a whole number (got 'abc')"),
    (EVAL + ["--seq-len", "100000"], "--seq-len"),
    (EVAL + ["--buckets", "0"], "--buckets must be >= 1"),
    (EVAL + ["--buckets", "17"], "--buckets (17) is more than --seq-len (16)"),
    (EVAL + ["--windows", "0"], "--windows must be >= 1"),
    (EVAL + ["--eval-docs", "0"], "--eval-docs must be >= 1"),
    (EVAL + ["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N (got 'gpu')"),
    (EVAL + ["--device", "cuda:x"], "--device must be"),
    (EVAL + ["--tokenizer", "ROOT/missing.json"], "--tokenizer", "does not exist"),
    (EVAL + ["--tokenizer", "~nosuchuser/t.json"], "--tokenizer"),
    (EVAL + ["--data", "ROOT/missing"], "--data", "does not exist"),
    (EVAL + ["--data", ""], "--data is empty"),
    (EVAL + ["--checkpoint", "ROOT/missing"], "--checkpoint"),
    (EVAL + ["--tokenizer", "TOK300"], "--tokenizer", "has 300 ids but the checkpoint's model has 256"),
    (GEN + ["--tokenizer", "TOK300"], "--tokenizer", "has 300 ids"),
    (GEN + ["--max-new-tokens", "-5"], "--max-new-tokens must be >= 0 (got -5)"),
    (GEN + ["--temperature", "-0.5"], "--temperature must be a finite number >= 0 (got '-0.5')"),
    (GEN + ["--temperature", "nan"], "--temperature must be a finite number"),
    (GEN + ["--temperature", "hot"], "--temperature must be a finite number"),
    (GEN + ["--top-k", "-1"], "--top-k must be >= 0 (got -1)"),
    (GEN + ["--seed", "-1"], "--seed must be >= 0"),
    (GEN + ["--seed", str(2**64)], "--seed must be below 2**63"),
    (GEN + ["--device", "tpu"], "--device must be"),
    (GEN + ["--tokenizer", "ROOT/missing.json"], "--tokenizer", "does not exist"),
    (GEN + ["--prompt", ""], "--prompt is empty"),
    (TRAIN + ["--max-steps", "-1"], "--max-steps must be >= 1 (got -1)"),
    (TRAIN + ["--max-steps", "0"], "--max-steps must be >= 1 (got 0)"),
    (TRAIN + ["--out", ""], "--out is empty"),
    (TRAIN + ["--out", "  "], "--out is empty"),
    (TRAIN + ["--out", "a\x00b"], "--out"),
    (TRAIN + ["--bogus"], "unrecognized arguments: --bogus", "longctx train --help"),
    (["generate", "--prompt", "x"], "the following arguments are required: --checkpoint"),
    (["evaluate"], "invalid choice: 'evaluate'"),
    ([], "the following arguments are required"),
]


@pytest.mark.parametrize("args,needles", [(a, tuple(n)) for a, *n in BAD_ARGS],
                         ids=[" ".join(a[-2:]) or "none" for a, *_ in BAD_ARGS])
def test_a_bad_argument_is_one_sentence_and_exit_2(args, needles, run_dirs, capsys):
    _one_error(capsys, _fill(args, run_dirs), *needles)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("cmd", [EVAL, GEN])
def test_cuda_without_a_gpu_is_one_sentence(cmd, run_dirs, capsys):
    _one_error(capsys, _fill(cmd + ["--device", "cuda"], run_dirs), "--device cuda needs a CUDA GPU")


def test_good_arguments_still_work(run_dirs, capsys):
    assert main(_fill(EVAL + ["--json"], run_dirs)) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["buckets"]) == 4 and res["tokens"] == 16 and res["loss"] == res["loss"]  # not NaN
    assert main(_fill(GEN + ["--temperature", "0", "--top-k", "0", "--max-new-tokens", "0"], run_dirs)) == 0
    assert capsys.readouterr().out == "def \n"


def test_eval_prints_the_per_position_table_that_train_prints(run_dirs, capsys):
    """The table `longctx train` ends with, one column for the one checkpoint; --json gives the same numbers."""
    from longctx.train.evaluate import format_table

    assert main(_fill(EVAL + ["--json"], run_dirs)) == 0
    res = json.loads(capsys.readouterr().out)
    assert main(_fill(EVAL, run_dirs)) == 0
    out = capsys.readouterr().out
    head, *table = out.rstrip("\n").split("\n")
    assert head == "held-out loss by position (1 window of 16 tokens):"
    assert "\n".join(table) == format_table(res)
    assert table[0].split() == ["positions", "loss"] and len(table) == 4 + 2
    assert [ln.split()[0] for ln in table[1:]] == ["0-4", "4-8", "8-12", "12-16", "all"]
    assert float(table[-1].split()[1]) == pytest.approx(res["loss"], abs=5e-5)
    assert [float(ln.split()[1]) for ln in table[1:-1]] == pytest.approx([b["loss"] for b in res["buckets"]], abs=5e-5)


def test_generate_samples_only_ids_the_tokenizer_can_decode(run_dirs, capsys):
    """A model with more ids (300) than the byte tokenizer (256) would otherwise sample ids it cannot decode."""
    for t in ("1.0", "0"):
        assert main(_fill(["generate", "--checkpoint", "CK300", "--prompt", "def ", "--max-new-tokens", "64",
                           "--temperature", t, "--top-k", "0"], run_dirs)) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith("def ")


def test_a_prompt_with_undecodable_bytes_is_encoded_as_they_came(run_dirs, capsys):
    """argv holds undecodable bytes as lone surrogates (surrogateescape); the byte tokenizer takes the bytes."""
    assert main(_fill(GEN + ["--prompt", "caf\udce9 ", "--temperature", "0"], run_dirs)) == 0
    assert capsys.readouterr().out.startswith("caf\ufffd ")


# ------------------------------------------------------------------------------ property: any argument values
# Every subcommand, arguments drawn from whole numbers (negative, zero, huge) and odd text: main returns 0
# (or estimate's 1, "does not fit") or prints one error sentence and returns 2; it never raises. Sizes stay
# tiny: runs train 2 steps of the tiny model at 16 tokens, eval reads a 3-document folder, generate makes
# at most 3 tokens, estimate stays at lengths it answers at once.
ODD = st.one_of(st.sampled_from(["", " ", "0", "-1", "1.5", "nan", "inf", "-inf", "1e400", "abc", "é", "\udcff",
                                 "a\x00b", "-", "--", "-x", "~nosuchuser/x", "ROOT/missing"]), st.text(max_size=6))
INTS = st.one_of(st.integers(-3, 5), st.sampled_from([-2**63 - 1, -10**12, 10**12, 2**63, 2**64])).map(str)
SMALL = st.one_of(st.integers(-3, 3), st.just(-10**12)).map(str)  # no huge positives: they would take that long
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 5e-324, 1e-320, 1e308])).map(str)
DEVICES = st.one_of(st.sampled_from(["auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:", "gpu", "CPU"]), ODD)
TOKENIZERS = st.one_of(st.sampled_from(["byte", "TOK50", "TOK300", "ROOT/missing.json", "ROOT", "~nosuchuser/t.json"]), ODD)
CHECKPOINTS = st.one_of(st.sampled_from(["CK", "CK300", "ROOT/missing", "ROOT", "DATA"]), ODD)
SETS = st.one_of(st.sampled_from([
    "data.eval_windows=0", "model.vocab_size=97", "model.vocab_size=-1", "seed=-1", "stages.0.steps=0", "foo", "=",
    "data.path=", "device=cuda", "device=gpu", "log_every=0", "eval_every=1", "ckpt_every=1", "stages.0.seq_len=100000000",
    "data.tokenizer=TOK50", "data.tokenizer=TOK300", "data.separator=false", "stages.0.batch_size=2", "kernels.mhc=liger", "residual_impl=liger",
    "data.path=~nosuchuser/x", "data.tokenizer=~nosuchuser/t.json", "out_dir=a\x00b", "model.hidden_size=abc",
    "data.eval_docs=0", "stages.1.lr=1"]), ODD)
FLAGS = {
    "train": {"--max-steps": INTS, "--out": st.sampled_from(["OUT", "", " ", "a\x00b", "~nosuchuser/x", "rel dir/é"]),
              "--preset": st.sampled_from(["tiny", "small", "tyni", "", "h200-ref", "glm-5.3-flash", "h200-curriculum"]),
              "--set": SETS, "--config": st.sampled_from(["ROOT/missing.toml", "", "~nosuchuser/c.toml", "DATA"]),
              "--print-config": None, "--resume": None, "--quiet": None},
    "eval": {"--seq-len": INTS, "--windows": INTS, "--buckets": INTS, "--eval-docs": INTS, "--device": DEVICES,
             "--tokenizer": TOKENIZERS, "--checkpoint": CHECKPOINTS, "--json": None,
             "--data": st.one_of(st.sampled_from(["DATA", "DATA/doc0.txt", "ROOT/missing", "TOK50"]), ODD)},
    "generate": {"--max-new-tokens": st.one_of(SMALL, ODD), "--temperature": st.one_of(FLOATS, ODD), "--top-k": INTS,
                 "--seed": INTS, "--prompt": st.one_of(ODD, st.text(max_size=20)), "--device": DEVICES,
                 "--tokenizer": TOKENIZERS, "--checkpoint": CHECKPOINTS},
    "estimate": {"--seq-len": st.one_of(st.integers(-3, 5), st.sampled_from([-10**12, 65536, 2**20])).map(str),
                 "--cp": INTS, "--gpu": st.one_of(st.sampled_from(["h200", "h100", "b200", "cpu"]), ODD),
                 "--preset": st.one_of(st.sampled_from(["tiny", "small", "h200-ref", "glm-5.3-flash", "h200-curriculum"]), ODD),
                 "--set": st.one_of(st.sampled_from(["offload=0", "offload=maybe", "recompute=on", "seq_chunk=-1", "="]), ODD),
                 "--kernel": st.one_of(st.sampled_from(["mhc=auto", "mhc=torch", "mhc=liger", "kda_norm=fla", "kda=triton",
                                                        "mhx=torch", "mhc", "=torch"]), ODD),
                 "--phases": None, "--json": None},
    "export": {"--checkpoint": CHECKPOINTS, "--out": st.sampled_from(["OUT", "", " ", "~nosuchuser/x", "DATA/doc0.txt"])},
}
BASE = {  # what keeps each run small; drawn arguments come after and override
    "train": ["--preset", "tiny", "--set", "data.path=TRAIN", "--set", "stages=[{seq_len = 16, steps = 2, lr = 1e-3}]",
              "--set", "data.eval_windows=1", "--set", "log_every=1000", "--out", "OUT"],
    "eval": ["--checkpoint", "CK", "--data", "DATA", "--seq-len", "8", "--windows", "1", "--buckets", "2"],
    "generate": ["--checkpoint", "CK", "--prompt", "def ", "--max-new-tokens", "2"],
    "estimate": ["--seq-len", "4096", "--preset", "tiny"],
    "export": ["--checkpoint", "CK", "--out", "OUT"],
}


@st.composite
def argv_for(draw, cmd):
    args = ["--bogus"] if draw(st.integers(0, 9)) == 0 else []  # now and then an unknown flag
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS[cmd])), max_size=4)):
        args += [flag] if FLAGS[cmd][flag] is None else [flag, draw(FLAGS[cmd][flag])]
    if cmd == "train" and not {"tiny", "small"} >= set(args[i + 1] for i, a in enumerate(args[:-1]) if a == "--preset"):
        args.append("--print-config")  # the large presets are resolved and printed, never built on the CPU
    return [cmd, *BASE[cmd], *args]


@pytest.fixture(scope="module")
def fuzz_dirs(run_dirs):
    """run_dirs plus a training text, and a scratch working folder: relative paths land there."""
    root = os.path.join(run_dirs["ROOT"], "fuzz")
    os.makedirs(root)
    with open(os.path.join(root, "train.txt"), "w") as f:
        f.write("def double(x):\n    return 2 * x\n\n" * 200)
    cwd = os.getcwd()
    os.chdir(root)
    yield {**run_dirs, "TRAIN": os.path.join(root, "train.txt"), "FUZZ": root}
    os.chdir(cwd)


def _run_fuzzed(argv, dirs):
    import tempfile

    out = os.path.join(tempfile.mkdtemp(dir=dirs["FUZZ"]), "out")  # a fresh folder per example
    argv = [out if a == "OUT" else a for a in _fill(argv, dirs)]
    argv = [a.replace("data.path=TRAIN", "data.path=" + dirs["TRAIN"]).replace("=TOK50", "=" + dirs["TOK50"])
            .replace("=TOK300", "=" + dirs["TOK300"]) for a in argv]
    return main(argv)


@pytest.mark.parametrize("cmd", sorted(FLAGS))
def test_random_arguments_return_0_or_2_and_never_raise(cmd, fuzz_dirs):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(argv=argv_for(cmd))
    def check(argv):
        rc = _run_fuzzed(argv, fuzz_dirs)
        assert rc in ((0, 1, 2) if cmd == "estimate" else (0, 2)), (argv, rc)

    check()


def test_a_tiny_temperature_samples_as_greedy(run_dirs, capsys):
    """5e-324 is a valid temperature > 0; float32 would round it to 0 and divide by it."""
    outs = []
    for t in ("5e-324", "0"):
        assert main(_fill(GEN + ["--temperature", t, "--max-new-tokens", "8"], run_dirs)) == 0, capsys.readouterr().err
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("extra", [["--vision-from", "ROOT/missing"], ["--out", "a\x00b"]], ids=["vision-from", "nul-out"])
def test_export_refuses_a_missing_vision_tower_and_a_nul_path(extra, fuzz_dirs, capsys):
    assert _run_fuzzed(["export", *BASE["export"], *extra], fuzz_dirs) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
