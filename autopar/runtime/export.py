"""A checkpoint out of autopar: the model's full weights, by the original model's names.

    autopar export ckpt --to torch weights.pt          # torch.load(..., weights_only=True)
    autopar export ckpt --to hf out/ --model hf:gpt2   # a save_pretrained folder

``export_checkpoint`` reads a checkpoint folder (or the newest complete one in a
``Checkpointer`` directory) in one process, with no process group: its files are checked against
the manifest first (``runtime.integrity``), then DCP's reader assembles every weight whole from
the shards of whatever plan saved it (``torch.distributed.checkpoint.format_utils``). The
optimizer state stays behind. The output is written under a temporary name and renamed.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.runtime.checkpoint import MANIFEST, check_files, saved_plan

_STEP = re.compile(r"^step-(\d+)$")

FORMATS = ("torch", "hf")


def checkpoint_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it is a checkpoint folder, else the newest complete ``step-<n>`` in it."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    steps = sorted(
        (int(m.group(1)), p)
        for p in (path.iterdir() if path.is_dir() else ())
        if (m := _STEP.match(p.name)) and (p / MANIFEST).is_file()
    )
    if not steps:
        raise AutoparError(
            f"{str(path)!r} is neither a checkpoint folder nor a directory of them (no .metadata, no "
            "complete step-<n>): give the folder ParallelModel.save or a Checkpointer wrote"
        )
    return steps[-1][1]


def full_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every weight of the checkpoint at ``path``, whole, by the model's own names (CPU)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = checkpoint_folder(path)
    check_files(folder)
    state: dict[str, Any] = {}
    _load_state_dict(  # DCP's own single-process path (format_utils.dcp_to_torch_save uses it)
        state,
        storage_reader=FileSystemReader(str(folder)),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    model = state.get("model")
    if not isinstance(model, dict) or not model:
        raise AutoparError(f"the checkpoint {str(folder)!r} holds no model weights")
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def export_checkpoint(
    path: str | os.PathLike[str], out: str | os.PathLike[str], *, to: str = "torch", model: str | None = None
) -> Path:
    """Write the checkpoint at ``path`` to ``out``: ``to="torch"``, a ``torch.save`` state dict;
    ``to="hf"``, a Hugging Face ``save_pretrained`` folder of ``model`` (a MODEL spec; default: the
    model the checkpoint's plan names) with the weights loaded. Returns the checkpoint folder read."""
    if to not in FORMATS:
        raise AutoparError(f"unknown export format {to!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    if not out.parent.is_dir():
        raise AutoparError(f"can't export to {str(out)!r}: {str(out.parent)!r} does not exist")
    folder = checkpoint_folder(path)
    weights = full_weights(folder)
    tmp = out.with_name(out.name + ".tmp")
    _remove(tmp)
    try:
        if to == "torch":
            torch.save(weights, tmp)
        else:
            _save_pretrained(weights, model or _plan_model(folder), tmp)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError as e:
        _remove(tmp)
        raise AutoparError(f"can't write {str(out)!r}: {e.strerror or e}") from None
    return folder


def _remove(path: Path) -> None:
    """A leftover temporary output, file or folder, gone."""
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _plan_model(folder: Path) -> str:
    plan = saved_plan(folder)
    if plan is None:
        raise AutoparError(f"the checkpoint {str(folder)!r} names no model: give --model MODEL")
    return plan.model


def _save_pretrained(weights: dict[str, torch.Tensor], spec: str, out: Path) -> None:
    """Build ``spec``, load ``weights`` into it exactly (every key, every shape) and save it the
    Hugging Face way."""
    from autopar.zoo.spec import build_model, resolve

    meta = resolve(spec, dtype=None).module  # checked on the meta device before any weight is made
    if not hasattr(meta, "save_pretrained"):
        raise AutoparError(
            f"{spec!r} builds a {type(meta).__name__}, not a Hugging Face model: export with --to torch"
        )
    shapes = {k: p.shape for k, p in meta.named_parameters(remove_duplicate=False)}  # tied: each name
    missing = sorted(k for k in shapes if k not in weights)
    extra = sorted(k for k in weights if k not in shapes)
    wrong = sorted(k for k in shapes if k in weights and weights[k].shape != shapes[k])
    if missing or extra or wrong:
        first = f"it lacks {missing[0]!r}" if missing else f"it has {extra[0]!r}" if extra else ""
        first = first or f"its {wrong[0]!r} is {list(weights[wrong[0]].shape)}"
        raise AutoparError(f"the checkpoint's weights are not {spec!r}'s: {first}")
    module: nn.Module = build_model(spec)
    params = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.dtype))
    getattr(module, "save_pretrained")(str(out))  # noqa: B009 (an nn.Module attribute to mypy)


__all__ = ["FORMATS", "checkpoint_folder", "export_checkpoint", "full_weights"]
