"""The [parallel] section: defaults, --set and --print-config, and one-sentence errors, with or
without the world size torchrun gives."""

from __future__ import annotations

import json

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from longctx.config.loading import load_train_config, to_toml
from longctx.config.parallel import ParallelConfig
from longctx.config.train import TrainConfig
from longctx.errors import ConfigError


def test_defaults_set_print_and_round_trip():
    c = load_train_config(None, "tiny", [])
    assert c.parallel == ParallelConfig(cp=1, dp=None, kda_cp="hidden_gather")
    c = load_train_config(None, "tiny", ["parallel.cp=2", "parallel.kda_cp=chunk_state"])
    assert (c.parallel.cp, c.parallel.dp, c.parallel.kda_cp) == (2, None, "chunk_state")
    text = to_toml(c)
    assert "\n[parallel]\ncp = 2\n# dp = (unset)\nkda_cp = \"chunk_state\"\n" in text
    assert tomllib.loads(text)["parallel"] == {"cp": 2, "kda_cp": "chunk_state", "ep": 1}
    assert TrainConfig.from_dict(json.loads(c.to_json())) == c


def test_the_mesh_reads_the_config_class():
    from longctx.distributed import ParallelConfig as FromDistributed

    assert FromDistributed is ParallelConfig


@pytest.mark.parametrize("sets,needle", [
    (["parallel.cp=0"], "parallel.cp must be a positive integer"),
    (["parallel.dp=1.5"], "parallel.dp must be a positive integer"),
    (["parallel.kda_cp=hidden"], "did you mean hidden_gather"),
    (["parallel.cpp=2"], "did you mean parallel.cp"),
    (["parallel=2"], "parallel must be a table"),
    (["parallel.cp=3"], "model.kda_heads = 2 is not a multiple of parallel.cp = 3"),
])
def test_mistakes_are_one_sentence(sets, needle):
    with pytest.raises(ConfigError) as e:
        load_train_config(None, "tiny", sets)
    assert needle in str(e.value) and str(e.value).count(". ") == 0, str(e.value)


def test_against_the_world_size():
    assert ParallelConfig(cp=2).validate(8).dp == 4
    assert ParallelConfig().validate(3) == ParallelConfig(cp=1, dp=3)
    with pytest.raises(ConfigError, match="does not divide the 6 processes"):
        ParallelConfig(cp=4).validate(6)
    with pytest.raises(ConfigError, match="set parallel.dp to 2 or leave it unset"):
        ParallelConfig(cp=2, dp=3).validate(4)
