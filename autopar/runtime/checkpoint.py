"""Checkpoints of a ``ParallelModel``: DCP folders that any plan of the same model loads
(``ParallelModel.state_dict`` saves one layout for every plan), written so that a failed save
never replaces a good checkpoint, and refused in one line when they hold another model.

A checkpoint folder holds DCP's files (``.metadata`` and one ``.distcp`` file per rank) and
``autopar.json``: the model, the plan's hash and mesh, and the optimizer it was saved with. Its
tensors load with DCP's own reader (no pickled objects); the manifest is JSON.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.files import write_atomic
from autopar.plan import Plan
from autopar.runtime.distributed import PEER_LOST
from autopar.runtime.integrity import BrokenCheckpointError, folder_digest, folder_problem

MANIFEST = "autopar.json"
"""The checkpoint's description, next to DCP's ``.metadata``."""


def save_checkpoint(
    pm: Any,
    path: str | os.PathLike[str],
    trainer: dict[str, Any] | None = None,
    *,
    previous: Path | None = None,
) -> None:
    """Save ``pm``'s model, optimizer (and loss-scaler) state to the folder ``path``. Every rank
    writes into ``<path>.tmp``; once all have finished, rank 0 writes the manifest (with
    ``trainer``, the loop's own JSON state: step, data position, random states) and swaps the
    folder in, so ``path`` holds either the previous checkpoint or this one, never a mix. A save
    that fails (a full disk, a read-only folder, a peer that died) raises one line on every rank
    saying why and leaves ``path``, ``previous`` (the newest checkpoint before it; default: ``path``
    if it holds one) and the training state as they were. Collective: call on every rank (a file
    system all ranks share)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    if previous is None and (path / ".metadata").is_file():
        previous = path
    tmp = begin_save(path)
    free_before = free_bytes(path.parent)
    try:
        dcp.save(pm.state_dict(), checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank's failed
        failed_save(path, e, previous=previous, free_before=free_before)
    commit_save(pm, path, trainer)


def free_bytes(folder: Path) -> int:
    """Free bytes of ``folder``'s file system (0 where it can't be read)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def _agree(problem: str | None) -> None:
    """Raise ``problem`` (found on any rank) on every rank, so none waits in a collective."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    first = next((p for p in found if p), None)
    if first:
        raise AutoparError(first)


def begin_save(path: str | os.PathLike[str]) -> Path:
    """Make ``<path>.tmp`` empty for a save into ``path``; the temporary folder. Collective."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    problem = None
    if dist.get_rank() == 0:
        if not path.parent.is_dir():
            problem = f"can't save a checkpoint to {str(path)!r}: {str(path.parent)!r} does not exist"
        else:
            shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted save left
    _agree(problem)
    return tmp


def failed_save(
    path: str | os.PathLike[str], error: BaseException, *, previous: Path | None = None, free_before: int = 0
) -> NoReturn:
    """After a failed write into ``<path>.tmp``: remove it, raise one line on every rank saying
    why (``save_cause``), that the training state is intact, and that ``previous`` (the newest
    checkpoint before this save, if any) is too."""
    path = Path(path)
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: rank → its exception
    where, first_error = "", error
    if isinstance(failures, dict) and failures:
        rank, first_error = min(failures.items())
        first_error = (
            first_error[0] if isinstance(first_error, tuple) else first_error
        )  # (exception, traceback)
        where = f"rank {rank}: "
    cause, advice = save_cause(error, path.parent, free_before)  # before the partial files go
    if dist.get_rank() == 0:
        shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)
    first = where + (str(first_error).strip().splitlines() or [type(first_error).__name__])[0]
    kept = (
        f"the previous checkpoint is intact ({previous.name}) and so is the training state"
        if previous is not None
        else "there is no earlier checkpoint; the training state is intact"
    )
    raise AutoparError(
        f"saving the checkpoint {str(path)!r} failed{cause} ({first}); {kept}: {advice}"
    ) from None


FULL_BYTES = 16 << 20
"""Free bytes under which a folder's file system counts as full after a failed write (a write
that ran out of space leaves a block or so)."""


def save_cause(error: BaseException, folder: Path, free_before: int = 0) -> tuple[str, str]:
    """(": why", what to do) for a failed save: the errno of an ``OSError`` anywhere in the error
    (DCP's per-rank failures and causes included: ENOSPC, EDQUOT, EROFS, EACCES); a peer that
    died; else the file system as the failure left it (torch wraps a short write as "unexpected pos
    …"): nearly no space left, or a folder this process can't write. ("", generic advice) else."""
    full = ": no space left on the device", "free space, or checkpoint to another folder"
    unwritable = f": {str(folder)!r} can't be written (read-only or no permission)", "give a writable folder"
    chain = _chain(error)
    codes = {getattr(e, "errno", None) for e in chain}
    if codes & {errno.ENOSPC, errno.EDQUOT}:
        return full
    if codes & {errno.EROFS, errno.EACCES, errno.EPERM}:
        return unwritable
    if any(sign in str(e) for e in chain for sign in PEER_LOST):
        return (
            ": another process died or stopped answering during the save",
            "under torchrun --max-restarts the group restarts and resumes from the last checkpoint",
        )
    free = free_bytes(folder) if folder.is_dir() else None
    if free is not None and free < max(FULL_BYTES, free_before // 50):
        return f"{full[0]} ({free / 2**20:.1f} MiB free)", full[1]
    if folder.is_dir() and not os.access(folder, os.W_OK):
        return unwritable
    return "", "free space or give a writable folder if that is the cause"


def _chain(error: BaseException) -> list[BaseException]:
    """``error``, its causes and contexts, and DCP's per-rank failures (``failures``), each once."""
    found: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if any(e is f for f in found):
            continue
        found.append(e)
        failures = getattr(e, "failures", None)
        nested = list(failures.values()) if isinstance(failures, dict) else []
        nested = [f[0] if isinstance(f, tuple) else f for f in nested]  # (exception, traceback)
        todo += [x for x in (e.__cause__, e.__context__, *nested) if isinstance(x, BaseException)]
    return found


def commit_save(pm: Any, path: str | os.PathLike[str], trainer: dict[str, Any] | None) -> None:
    """Every rank's shard of ``<path>.tmp`` is written: record the files, write the manifest and
    swap the folder in as ``path``. Collective."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    dist.barrier()  # every rank's shard is on disk
    files = folder_digest(tmp, skip=(MANIFEST,))
    problem = None
    if dist.get_rank() == 0:
        manifest = {**_manifest(pm), "trainer": trainer or {}, "files": files}
        try:
            write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
            old = path.with_name(path.name + ".old")
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        except (AutoparError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            problem = f"saving the checkpoint {str(path)!r} failed at its manifest: {e}"
    _agree(problem)


def _manifest(pm: Any) -> dict[str, Any]:
    plan = pm.plan
    return {
        "model": plan.model,
        "plan_hash": plan.hash,
        "mesh": dict(plan.mesh),
        "optimizer": type(pm.optimizer.optimizers[0]).__name__ if pm.optimizer.optimizers else None,
        "plan": json.loads(plan.to_json()),
    }


def load_checkpoint(pm: Any, path: str | os.PathLike[str]) -> None:
    """Load the checkpoint folder ``path`` into ``pm`` (saved under any plan of the same model).
    Refuses, on every rank before any tensor is read, a folder that is no checkpoint, another
    model's (a missing parameter or another shape) or one saved with another optimizer."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    check_files(path)  # an autopar checkpoint's manifest lists every file, .metadata too: damage
    if not (path / ".metadata").is_file():
        raise AutoparError(
            f"{str(path)!r} is not a checkpoint folder (it has no .metadata): give a folder that "
            "ParallelModel.save (or torch.distributed.checkpoint.save) wrote"
        )
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = pm.state_dict()
    # what every rank will load (a pipeline rank holds its stages only): all ranks decide alike
    mine = {
        "model": {f"model.{k}": list(v.shape) for k, v in state["model"].items() if hasattr(v, "shape")},
        "optimizer": sorted(f"optimizer.{k}" for k in state["optimizer"]),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    wanted = {k: shape for part in everyone for k, shape in part["model"].items()}
    optimizer_keys = sorted({k for part in everyone for k in part["optimizer"]})
    check_checkpoint(path, saved, wanted, optimizer_keys, pm.plan.model, _manifest(pm)["optimizer"])
    dcp.load(state, checkpoint_id=str(path))
    pm.load_state_dict(state)


def check_checkpoint(
    path: Path,
    saved: dict[str, Any],
    wanted: dict[str, list[int]],
    optimizer_keys: list[str],
    model: str,
    optimizer: str | None = None,
) -> None:
    """Raise one line when the checkpoint's tensors (DCP metadata ``saved``: key → sizes) are not
    the ones the model loads (``wanted``: ``model.<FQN>`` → global shape, over all ranks) or lack
    one of its optimizer's entries: name the two models and the first tensor that differs."""
    manifest = _read_manifest(path)
    theirs = manifest.get("model", "another model")
    extra = sorted(k for k in saved if k.startswith("model.") and k not in wanted)
    detail = f"it holds {extra[0][6:]!r}, which this model lacks" if extra else None
    for key, shape in wanted.items():
        entry = saved.get(key)
        size = list(getattr(entry, "size", ()))
        if detail is None and entry is None:
            detail = f"it has no {key[6:]!r}"
        elif detail is None and size != shape:
            detail = f"its {key[6:]!r} is {size}, this model's is {shape}"
    if detail is not None:
        ours = sum(math.prod(shape) for shape in wanted.values())
        raise AutoparError(
            f"the checkpoint {str(path)!r} holds {theirs} ({_count(saved):,} weights), not this "
            f"model, {model} ({ours:,} weights): {detail}"
        )
    missing = [k for k in optimizer_keys if k not in saved]
    if missing:
        used = manifest.get("optimizer") or "another optimizer"
        raise AutoparError(
            f"the checkpoint {str(path)!r} has no optimizer state {missing[0][10:]!r}: it was saved with "
            f"{used}, this model's optimizer is {optimizer}; build it the same way (parallelize's "
            "optimizer_cls)"
        )


def check_files(path: Path) -> None:
    """Raise ``BrokenCheckpointError`` on every rank when a file of the checkpoint ``path`` is not
    the one its manifest recorded (a folder saved with plain DCP has no record: nothing to check).
    Collective."""
    try:
        files = _read_manifest(path).get("files")
    except AutoparError as e:
        raise BrokenCheckpointError(f"the checkpoint {str(path)!r} is damaged: its {e}") from None
    problem = folder_problem(path, files) if isinstance(files, dict) else None
    if problem:
        raise BrokenCheckpointError(f"the checkpoint {str(path)!r} is damaged: {problem}")


def saved_plan(path: str | os.PathLike[str]) -> Plan | None:
    """The plan the checkpoint folder ``path`` was saved under (None: saved without one)."""
    text = _read_manifest(Path(path)).get("plan")
    return Plan.from_json(json.dumps(text)) if isinstance(text, dict) else None


def trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The loop state saved with the checkpoint folder ``path`` (``save_checkpoint``'s
    ``trainer``; {} for a checkpoint saved without one)."""
    state = _read_manifest(Path(path)).get("trainer", {})
    return state if isinstance(state, dict) else {}


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, or {} for a folder saved with plain DCP."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise AutoparError(f"manifest {MANIFEST} can't be read ({e})") from None
    return manifest if isinstance(manifest, dict) else {}


def _count(saved: dict[str, Any]) -> int:
    return sum(math.prod(m.size) for k, m in saved.items() if k.startswith("model.") and hasattr(m, "size"))


__all__ = [
    "MANIFEST",
    "BrokenCheckpointError",
    "begin_save",
    "check_checkpoint",
    "commit_save",
    "failed_save",
    "free_bytes",
    "load_checkpoint",
    "save_checkpoint",
    "saved_plan",
    "trainer_state",
]
