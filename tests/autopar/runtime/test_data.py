"""GlobalBatches: the global batch of a step depends on the step alone, not on the world size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autopar.errors import AutoparError
from autopar.runtime.data import GlobalBatches
from autopar.strategy import Strategy


def _pm(dp: int, rank: int, batch: int = 6) -> SimpleNamespace:
    return SimpleNamespace(plan=SimpleNamespace(strategy=Strategy(dp=dp, global_batch=batch)), dp_rank=rank)


def test_every_sample_once_per_epoch_and_the_same_rows_on_any_world() -> None:
    batches = GlobalBatches(10, 6, seed=3)
    seen = torch.cat([batches.indices(k) for k in range(5)])  # 30 samples: 3 epochs across steps
    for epoch in range(3):
        assert sorted(seen[10 * epoch : 10 * epoch + 10].tolist()) == list(range(10))
    assert not torch.equal(seen[:10], seen[10:20])  # each epoch its own order
    for step in range(5):
        whole = batches.indices(step)
        for dp in (1, 2, 3, 6):
            rows = torch.cat([batches.local(step, _pm(dp, r)) for r in range(dp)])
            assert torch.equal(rows, whole), (step, dp)
    assert torch.equal(GlobalBatches(10, 6, seed=3).indices(4), batches.indices(4))  # a restart
    assert GlobalBatches(10, 4, shuffle=False).indices(2).tolist() == [8, 9, 0, 1]


def test_a_batch_size_the_plan_does_not_have_is_refused() -> None:
    with pytest.raises(AutoparError, match="the batches hold 6 samples but the plan's global batch is 8"):
        GlobalBatches(10, 6).local(0, _pm(2, 0, batch=8))
    with pytest.raises(AutoparError, match="must be at least 1"):
        GlobalBatches(0, 6)
