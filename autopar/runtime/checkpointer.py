"""Checkpoints on a schedule, resumed by themselves: ``Checkpointer(dir, every=N, keep=K)``.

    ckpt = autopar.Checkpointer("ckpt", every=100, keep=3)
    start = ckpt.resume(pm)                    # 0, or the step after the newest checkpoint
    for step in range(start, steps):
        pm.train_step(batch_for(step))         # the batch a function of the step: same data order
        ckpt.step_done(pm, step)               # saves every N steps, and on SIGTERM (then exits)

Each checkpoint is a folder ``step-<n>`` that ``ParallelModel.save`` writes (DCP shards and a
JSON manifest, swapped in whole: a folder with that name is complete). The manifest keeps the
plan, every file's size and CRC-32 (a damaged checkpoint is skipped on resume, for the one
before it) and the loop's state: the step, the data position (``samples``: global samples
consumed, step × global batch, whatever the world size), every rank's torch random state
(restored when the world size is the same; a world of another size keeps the seed it was
given), and what the caller adds. After a save completes, all but the newest ``keep`` are
deleted; with ``async_save`` the write runs while training goes on. SIGTERM (a preemption notice) is
caught: at the end of the current step every rank saves once more and the job exits 0, so a
restart (``torchrun --max-restarts``) resumes from it.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.checkpoint import (
    MANIFEST,
    BrokenCheckpointError,
    begin_save,
    commit_save,
    failed_save,
    free_bytes,
    save_checkpoint,
    trainer_state,
)
from autopar.runtime.distributed import group_timeout_s, local_device

_NAME = re.compile(r"^step-(\d+)$")
_ASIDE = re.compile(r"^step-(\d+)\.damaged(-\d+)?$")


class Checkpointer:
    """Save ``ParallelModel`` state every ``every`` steps into ``directory``, keep the newest
    ``keep``, resume from the newest complete one (see the module docstring). ``async_save``:
    DCP copies the state to CPU memory and writes it from a thread while training goes on (the
    checkpoint becomes visible, and older ones are pruned, once every rank's write is done).
    ``scheduler``: an LR scheduler whose state (JSON: ``state_dict()``) is saved and restored with
    the rest. ``on_no_good``: when checkpoint folders exist but none can be loaded, ``"stop"``
    (raise, naming them: nothing is overwritten) or ``"start"`` (train from step 0, deliberately).
    Construct it on every rank (with ``async_save`` it makes a gloo group for the writes)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every: int,
        keep: int = 2,
        async_save: bool = False,
        scheduler: Any = None,
        on_no_good: str = "stop",
    ) -> None:
        if every < 1 or keep < 1:
            raise AutoparError(f"checkpoint every {every} steps keeping {keep}: both must be at least 1")
        if on_no_good not in ("stop", "start"):
            raise AutoparError(f"on_no_good must be 'stop' or 'start', got {on_no_good!r}")
        self.directory, self.every, self.keep, self.scheduler = Path(directory), every, keep, scheduler
        self.on_no_good = on_no_good
        self.preempted = False
        self.blocked_s = 0.0
        """Seconds the last save held the training loop (with ``async_save``: the copy to CPU)."""
        timeout = datetime.timedelta(seconds=group_timeout_s())  # new groups default to 30 min
        self._group = dist.new_group(backend="gloo", timeout=timeout) if async_save else None
        self._pending: _Pending | None = None
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.preempted = True  # acted on at the end of the step: collectives can't run in a handler

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint (a ``step-<n>`` with its manifest), oldest
        first: the ones ``keep`` counts (a damaged one found on resume is set aside, not counted)."""
        return [(step, p) for step, p in self._folders() if (p / MANIFEST).is_file()]

    def _folders(self) -> list[tuple[int, Path]]:
        """(step, folder) of every ``step-<n>``, complete or not, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def set_aside(self) -> list[Path]:
        """The damaged checkpoints ``resume`` moved aside (``step-<n>.damaged``), oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _ASIDE.match(p.name))

    def resume(self, pm: Any) -> int:
        """Load the newest checkpoint that loads into ``pm``; the step to run next (0: none yet).
        A damaged one — a file not as written, no manifest, a manifest whose step is not the
        folder's — is moved aside to ``step-<n>.damaged`` with one line saying why, for the one
        before it. Where folders exist but none loads, ``on_no_good`` decides: stop (one line,
        nothing overwritten) or start from step 0. Collective."""
        if dist.get_rank() == 0 and self.directory.is_dir():  # what an interrupted save left
            for leftover in self.directory.glob("step-*.tmp"):
                shutil.rmtree(leftover, ignore_errors=True)
        dist.barrier()
        for step, path in reversed(self._folders()):
            problem = _agreed(_folder_problem(path, step))
            if problem is None:
                try:
                    pm.load(str(path))
                except BrokenCheckpointError as e:  # every rank saw it: all move on together
                    problem = str(e)
            if problem is not None:
                self._put_aside(path, problem)
                continue
            self._restore(path)
            return step + 1
        aside = [p.name for p in self.set_aside()]
        if aside and self.on_no_good == "stop":
            raise AutoparError(
                f"no checkpoint in {str(self.directory)!r} can be resumed from: {len(aside)} damaged, set "
                f"aside ({', '.join(aside[-3:])}{' …' if len(aside) > 3 else ''}); to train from step 0 "
                "deliberately, pass Checkpointer(..., on_no_good='start') (examples/train_gpt.py: "
                "--restart-from-scratch), or remove them"
            )
        if aside and dist.get_rank() == 0:
            print(
                f"autopar: training from step 0 (on_no_good='start'); {len(aside)} damaged "
                "checkpoints set aside",
                file=sys.stderr,
            )
        dist.barrier()
        return 0

    def _put_aside(self, path: Path, problem: str) -> None:
        """Rename the damaged ``path`` to ``<path>.damaged`` (the first free name), saying so on rank
        0. Collective."""
        aside = path.with_name(path.name + ".damaged")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.damaged-{n}")
        if dist.get_rank() == 0:
            os.replace(path, aside)
            print(f"autopar: skipping {problem}; set aside as {aside.name}", file=sys.stderr, flush=True)
        dist.barrier()

    def _restore(self, path: Path) -> None:
        """The loop state saved beside the weights: the scheduler's, this rank's random state."""
        trainer = trainer_state(path)
        if self.scheduler is not None and "scheduler" in trainer:
            self.scheduler.load_state_dict(trainer["scheduler"])
        rng = trainer.get("rng", [])
        if len(rng) == dist.get_world_size():
            torch.set_rng_state(
                torch.frombuffer(bytearray(base64.b64decode(rng[dist.get_rank()])), dtype=torch.uint8)
            )

    def step_done(self, pm: Any, step: int, **extra: Any) -> bool:
        """After step ``step``: save when it is the ``every``-th, or when any rank was sent
        SIGTERM (then exit the process, status 0). ``extra``: more JSON state to keep. Returns
        whether it saved. Collective."""
        # one MAX all-reduce per step: any rank preempted; any rank's async write still running
        flags = torch.tensor(
            [int(self.preempted), int(self._pending is not None and not self._pending.done())],
            device=local_device(),  # NCCL reduces device tensors only
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        preempted, written = bool(flags[0]), not bool(flags[1])
        if self._pending is not None and written:
            self._commit()
        due = preempted or (step + 1) % self.every == 0
        if due:
            self.save(pm, step, sync=preempted, **extra)
        if preempted:
            dist.destroy_process_group()
            raise SystemExit(0)
        return due

    def save(self, pm: Any, step: int, *, sync: bool = False, **extra: Any) -> Path:
        """Save now as the checkpoint of step ``step`` (``sync``: wait for the write even with
        ``async_save``), then delete all but the newest ``keep``. Collective."""
        self.wait()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode())
        path = self.directory / f"step-{step:09d}"
        samples = (step + 1) * pm.plan.strategy.global_batch  # the data position, world-size free
        trainer = {"step": step, "samples": samples, "rng": states, **extra}
        if self.scheduler is not None:
            trainer["scheduler"] = _json_state(self.scheduler)
        kept = self.checkpoints()
        previous = kept[-1][1] if kept else None
        if self._group is None:
            save_checkpoint(pm, path, trainer, previous=previous)
            self._prune()
        else:
            self._pending = _Pending.start(pm, path, trainer, self._group, previous)
            if sync:
                self.wait()
        self.blocked_s = time.perf_counter() - start
        return path

    def wait(self) -> None:
        """Finish an asynchronous save in flight (its checkpoint then visible). Collective."""
        if self._pending is not None:
            self._commit()

    def _commit(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        pending.commit()
        self._prune()

    def _prune(self) -> None:
        if dist.get_rank() == 0:
            for _, old in self.checkpoints()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def close(self) -> None:
        """Finish a save in flight and give SIGTERM back to the handler it had before."""
        self.wait()
        signal.signal(signal.SIGTERM, self._previous)


def _folder_problem(path: Path, step: int) -> str | None:
    """Why the checkpoint folder ``path`` (named for ``step``) can't be what it says, before its
    files are read: no manifest, an unreadable one, or one that records another step."""
    if not (path / MANIFEST).is_file():
        return (
            f"the checkpoint {str(path)!r} is damaged: it has no {MANIFEST} (its save never finished, "
            "or the file was removed)"
        )
    try:
        saved = trainer_state(path).get("step")
    except AutoparError as e:
        return f"the checkpoint {str(path)!r} is damaged: its {e}"
    if saved is not None and saved != step:
        return (
            f"the checkpoint {str(path)!r} is damaged: its manifest records step {saved}, its name "
            f"step {step} (a renamed or copied folder)"
        )
    return None


def _agreed(problem: str | None) -> str | None:
    """Rank 0's finding on every rank (they read the same folder; one decides, so none waits)."""
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _json_state(scheduler: Any) -> dict[str, Any]:
    """The scheduler's ``state_dict()``, refused in one line where JSON can't hold it (the
    manifest is JSON: nothing in it is unpickled)."""
    state = scheduler.state_dict()
    try:
        json.dumps(state)
    except TypeError as e:
        raise AutoparError(
            f"the LR scheduler's state ({type(scheduler).__name__}) is not JSON ({e}); keep it with "
            "step_done(..., **extra) in a form JSON holds, or rebuild it from the step on resume"
        ) from None
    return dict(state)


class _Pending:
    """An asynchronous save: DCP's future, and what committing it needs."""

    def __init__(
        self, future: Any, pm: Any, path: Path, trainer: dict[str, Any], previous: Path | None, free: int
    ) -> None:
        self.future, self.pm, self.path, self.trainer = future, pm, path, trainer
        self.previous, self.free_before = previous, free

    @classmethod
    def start(
        cls, pm: Any, path: Path, trainer: dict[str, Any], group: Any, previous: Path | None
    ) -> _Pending:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        tmp = begin_save(path)
        free = free_bytes(path.parent)
        try:  # the copy to CPU memory happens here; the write in DCP's thread
            future = dcp.async_save(pm.state_dict(), checkpoint_id=str(tmp), process_group=group)
        except (Exception, CheckpointException) as e:
            failed_save(path, e, previous=previous, free_before=free)
        return cls(future, pm, path, trainer, previous, free)

    def done(self) -> bool:
        return bool(self.future.done())

    def commit(self) -> None:
        """Wait for the write, then make the checkpoint visible (or raise why it failed)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self.future.result()
        except (Exception, CheckpointException) as e:  # failed on every rank when any rank's write did
            failed_save(self.path, e, previous=self.previous, free_before=self.free_before)
        commit_save(self.pm, self.path, self.trainer)


__all__ = ["Checkpointer"]
