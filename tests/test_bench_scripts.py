"""The bench scripts that take `--set` answer a user's mistake as the CLI does: one `error:` sentence on
stderr and exit code 2, no traceback (`longctx.errors.run_script`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from longctx.errors import ConfigError, run_script

ROOT = Path(__file__).resolve().parents[1]


def test_run_script_turns_a_user_error_into_one_sentence_and_exit_2(capsys):
    def main():
        raise ConfigError("stages.0.seq_len must be positive; set it to 256 or more.")

    with pytest.raises(SystemExit) as e:
        run_script(main)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: stages.0.seq_len must be positive; set it to 256 or more.\n"
    with pytest.raises(SystemExit) as e:
        run_script(lambda: 0)
    assert e.value.code == 0


def test_bench_sft_retrieval_says_which_setting_cannot_build_its_haystacks(tmp_path):
    # two `returns` questions do not fit the preset's 256-token haystacks: a DataError naming the fix
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sft_retrieval.py"), "--set", 'sft.kinds=["returns"]',
                           "--out", str(tmp_path / "run"), "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: sft: no 256-token haystack"), proc.stderr
    assert "sft.questions" in err[0]
    assert not (tmp_path / "r.json").exists()
