"""A checkpoint's files, checked against what was written: sizes and CRC-32s in the manifest.

A save records every file of the folder (DCP's ``.metadata`` and each rank's ``.distcp``) with its
size and CRC-32; a load checks them before any tensor is read, so a truncated shard, a flipped
byte or a missing file is a one-line ``BrokenCheckpointError``, never a partial load (and
``.metadata``, which DCP unpickles, is checked before it is opened). The work is split: rank r
reads the files whose position in the sorted list is r mod world, so each rank reads about
1/world of the checkpoint (CRC-32 runs at memory speed: ``benchmarks/checkpoint_io.py``).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from autopar.errors import AutoparError

CHUNK_BYTES = 16 << 20


class BrokenCheckpointError(AutoparError):
    """A checkpoint whose files are not the ones it was saved with (truncated, corrupted, missing,
    or an unreadable manifest)."""


def crc32_of(path: Path) -> int:
    """CRC-32 of the file's bytes (zlib's, streamed in 16 MiB chunks)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _rank_world() -> tuple[int, int]:
    """This rank and the world (0 and 1 outside a process group: ``autopar export``)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(mine: Any) -> list[Any]:
    """Every rank's ``mine`` (just this one outside a process group)."""
    if not dist.is_initialized():
        return [mine]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def _mine(names: list[str]) -> list[str]:
    """The files this rank reads: every world-th, from its rank."""
    rank, world = _rank_world()
    return names[rank::world]


def folder_digest(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, list[int]]:
    """{file name: [bytes, CRC-32]} of every file in ``folder`` but ``skip``, each rank reading its
    share. Collective (a folder every rank sees)."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in skip)
    mine = {name: [(folder / name).stat().st_size, crc32_of(folder / name)] for name in _mine(names)}
    return {name: entry for part in _gather(mine) for name, entry in sorted(part.items())}


def folder_problem(folder: Path, files: dict[str, list[int]]) -> str | None:
    """The first way ``folder`` differs from ``files`` (``folder_digest``'s record), or None,
    the same on every rank. Collective (or one process, outside a process group)."""
    problem: str | None = None
    names = sorted(files)
    for name in names if _rank_world()[0] == 0 else ():  # sizes: cheap, one rank
        path, (size, _) = folder / name, files[name]
        if not path.is_file():
            problem = problem or f"{name} is missing"
        elif path.stat().st_size != size:
            got = path.stat().st_size
            problem = problem or f"{name} has {got:,} bytes, {size:,} were written (truncated or overwritten)"
    for name in _mine(names):  # contents: each rank its share
        path, (size, crc) = folder / name, files[name]
        if path.is_file() and path.stat().st_size == size and crc32_of(path) != crc:
            problem = problem or f"{name}'s bytes do not match the CRC-32 written with it (corrupted)"
    return next((p for p in _gather(problem) if p), None)


__all__ = ["BrokenCheckpointError", "crc32_of", "folder_digest", "folder_problem"]
