"""Fixtures shared by the training tests."""

import random

import pytest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text file: tokenizing it is instant, unlike the embedded stdlib corpus."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog def class return import yield lambda".split()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(300)))
    return str(path)
