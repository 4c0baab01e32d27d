"""The meters of longctx.measure.meter: `LiveBytes` counts live storages (and stands in for a GPU's
capacity with `limit`)."""

from __future__ import annotations

import pytest
import torch

from longctx.measure.meter import LiveBytes


def test_live_bytes_counts_storages_and_frees():
    with LiveBytes() as lb:
        a = torch.ones(1000)  # 4000 bytes
        v = a[:10] + 0  # a new 40-byte storage
        w = a.view(10, 100)  # a view: nothing new
        del a, w
        b = torch.zeros(500)  # the next op sees a's storage gone
        assert lb.current == 40 + 2000
    assert lb.peak == 4040
    with pytest.raises(torch.OutOfMemoryError), LiveBytes(limit=1000):
        torch.ones(1000)
    del v, b
