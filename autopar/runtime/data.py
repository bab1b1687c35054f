"""The data order of a run, independent of its world size: ``GlobalBatches``.

    batches = autopar.GlobalBatches(len(dataset), global_batch=512, seed=0)
    rows = batches.local(step, pm)          # this data-parallel replica's sample indices
    pm.train_step(dataset[rows])

Step k's global batch is samples [k·B, (k+1)·B) of an endless run of epochs, each a permutation
of the dataset's indices drawn from ``seed`` and the epoch number. The position is the global
sample index, k·B (``Checkpointer`` keeps it as ``samples``): 4 processes or 2, a restart or
none, step k trains on the same B samples, and replica r of dp takes rows [r·B/dp, (r+1)·B/dp).
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.errors import AutoparError


class GlobalBatches:
    """Step → global batch of sample indices (see the module docstring)."""

    def __init__(self, num_samples: int, global_batch: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1 or global_batch < 1:
            raise AutoparError(f"{num_samples} samples in batches of {global_batch}: both must be at least 1")
        self.num_samples, self.global_batch, self.seed, self.shuffle = (
            num_samples,
            global_batch,
            seed,
            shuffle,
        )

    def _epoch(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def indices(self, step: int) -> torch.Tensor:
        """The sample indices of step ``step``'s global batch (global_batch of them)."""
        first = step * self.global_batch  # the global sample index where the step starts
        epochs = range(first // self.num_samples, (first + self.global_batch - 1) // self.num_samples + 1)
        order = torch.cat([self._epoch(e) for e in epochs])
        start = first - epochs[0] * self.num_samples
        return order[start : start + self.global_batch]

    def local(self, step: int, pm: Any) -> torch.Tensor:
        """The rows of step ``step``'s batch that ``pm``'s data-parallel replica trains on."""
        if self.global_batch != pm.plan.strategy.global_batch:
            raise AutoparError(
                f"the batches hold {self.global_batch} samples but the plan's global batch is "
                f"{pm.plan.strategy.global_batch}; make them the same"
            )
        start, stop = pm.plan.strategy.replica_rows(pm.dp_rank)
        return self.indices(step)[start:stop]


__all__ = ["GlobalBatches"]
