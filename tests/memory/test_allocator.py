"""longctx.memory.allocator: the CUDA allocator setting goes into the environment before CUDA starts,
a user's own PYTORCH_CUDA_ALLOC_CONF wins, and "" leaves torch's defaults."""

from __future__ import annotations

from longctx.memory import allocator


def test_default_goes_into_the_environment(monkeypatch):
    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.setattr(allocator, "_SET", [None])
    assert allocator.configure() == allocator.DEFAULT == "expandable_segments:True"
    import os

    assert os.environ[allocator.ENV] == allocator.DEFAULT
    assert allocator.configure("") == "torch defaults" and allocator.ENV not in os.environ  # ours: dropped
    assert allocator.configure("max_split_size_mb:512") == "max_split_size_mb:512"


def test_the_users_environment_wins(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "garbage_collection_threshold:0.8")
    monkeypatch.setattr(allocator, "_SET", [None])
    assert allocator.configure() == f"garbage_collection_threshold:0.8 (from {allocator.ENV})"
    import os

    assert os.environ[allocator.ENV] == "garbage_collection_threshold:0.8"


def test_train_config_has_the_setting_on_by_default():
    from longctx.config.train import TrainConfig

    assert TrainConfig().cuda_alloc == allocator.DEFAULT
