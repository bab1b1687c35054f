"""Checkpoints on a schedule, resumed by themselves: ``Checkpointer(dir, every=N, keep=K)``.

    ckpt = autopar.Checkpointer("ckpt", every=100, keep=3)
    start = ckpt.resume(pm)                    # 0, or the step after the newest checkpoint
    for step in range(start, steps):
        pm.train_step(batch_for(step))         # the batch a function of the step: same data order
        ckpt.step_done(pm, step)               # saves every N steps, and on SIGTERM (then exits)

Each checkpoint is a folder ``step-<n>`` that ``ParallelModel.save`` writes (DCP shards and a
JSON manifest, swapped in whole: a folder with that name is complete). The manifest keeps the
loop's state: the step, every rank's torch random state (restored when the world size is the
same; a world of another size keeps the seed it was given), and what the caller adds. After a
save completes, all but the newest ``keep`` are deleted. SIGTERM (a preemption notice) is
caught: at the end of the current step every rank saves once more and the job exits 0, so a
restart (``torchrun --max-restarts``) resumes from it.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.checkpoint import MANIFEST, save_checkpoint, trainer_state

_NAME = re.compile(r"^step-(\d+)$")


class Checkpointer:
    """Save ``ParallelModel`` state every ``every`` steps into ``directory``, keep the newest
    ``keep``, resume from the newest complete one (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], *, every: int, keep: int = 2) -> None:
        if every < 1 or keep < 1:
            raise AutoparError(f"checkpoint every {every} steps keeping {keep}: both must be at least 1")
        self.directory, self.every, self.keep = Path(directory), every, keep
        self.preempted = False
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.preempted = True  # acted on at the end of the step: collectives can't run in a handler

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name))]
        return sorted((step, p) for step, p in found if (p / MANIFEST).is_file())

    def resume(self, pm: Any) -> int:
        """Load the newest complete checkpoint into ``pm``; the step to run next (0: none yet)."""
        found = self.checkpoints()
        if not found:
            return 0
        step, path = found[-1]
        pm.load(str(path))
        rng = trainer_state(path).get("rng", [])
        if len(rng) == dist.get_world_size():
            torch.set_rng_state(
                torch.frombuffer(bytearray(base64.b64decode(rng[dist.get_rank()])), dtype=torch.uint8)
            )
        return step + 1

    def step_done(self, pm: Any, step: int, **extra: Any) -> bool:
        """After step ``step``: save when it is the ``every``-th, or when any rank was sent
        SIGTERM (then exit the process, status 0). ``extra``: more JSON state to keep. Returns
        whether it saved. Collective."""
        flag = torch.tensor([int(self.preempted)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        preempted = bool(flag.item())
        if preempted or (step + 1) % self.every == 0:
            self.save(pm, step, **extra)
        if preempted:
            dist.destroy_process_group()
            raise SystemExit(0)
        return preempted or (step + 1) % self.every == 0

    def save(self, pm: Any, step: int, **extra: Any) -> Path:
        """Save now as the checkpoint of step ``step``, then delete all but the newest ``keep``.
        Collective."""
        if dist.get_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode())
        path = self.directory / f"step-{step:09d}"
        save_checkpoint(pm, path, {"step": step, "rng": states, **extra})
        if dist.get_rank() == 0:
            for _, old in self.checkpoints()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    def close(self) -> None:
        """Give SIGTERM back to the handler it had before."""
        signal.signal(signal.SIGTERM, self._previous)


__all__ = ["Checkpointer"]
