"""The capture cache on disk: what a capture of a built-in model (or a run of torch's code) gave,
kept as JSON so that planning it again needs neither the capture nor torch.

Kinds of entry, each a JSON file named by the SHA-256 of its key:

- ``profile``: a ``ModelProfile`` (``ModelProfile.to_dict``) of a MODEL spec at one dtype,
  micro-batch and sequence length (``planner.profiles``);
- ``tp`` and ``tables``: the per-operator tensor-parallel choice of such a capture at one width
  on one cluster (``TPLayout``, and the Plan's table of it), which the ILPs solved on the graph
  (``planner.tp_layouts``);
- ``orders``: the per-rank action lists of torch's V-shaped pipeline schedules at one depth
  (``cost_models.pipeline``).

Every entry's name holds the code's fingerprint (SHA-256 of autopar's own source files and
torch's version): any change to the code that captures or prices invalidates every entry, and
the first entry the new code writes removes the old ones. The folder
is ``$AUTOPAR_CACHE`` (``off``: no cache), else ``$XDG_CACHE_HOME/autopar``, else
``~/.cache/autopar``. Entries are written atomically (a temporary file, then a rename), read
as JSON only (nothing is unpickled), and a folder that cannot be written leaves planning as
it was without a cache (``store`` returns False).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import pathlib
import tempfile
from functools import lru_cache
from importlib import metadata
from typing import Any

CACHE_ENV = "AUTOPAR_CACHE"
"""Environment variable naming the cache folder (``off`` disables the cache)."""


def cache_dir() -> pathlib.Path | None:
    """The cache folder (not created), or None when ``$AUTOPAR_CACHE`` is ``off``."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen == "off":
        return None
    if chosen:
        return pathlib.Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autopar"


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """SHA-256 of every source file of autopar (its packages ``autopar``, ``autopar.passes``,
    ``autopar.cost_models``, found without importing them) and torch's version: the code a
    cached capture came from."""
    digest = hashlib.sha256(_torch_version().encode())
    roots = {pathlib.Path(__file__).parent}
    for pkg in ("autopar.passes", "autopar.cost_models"):
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.submodule_search_locations is not None, pkg
        roots |= {pathlib.Path(p) for p in spec.submodule_search_locations}
    for path in sorted(f for root in roots for f in root.rglob("*.py")):
        digest.update(str(path.relative_to(path.parents[1])).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a source build: ask torch itself
        import torch

        return str(torch.__version__)


def _path(kind: str, key: dict[str, Any]) -> pathlib.Path | None:
    folder = cache_dir()
    if folder is None:
        return None
    text = json.dumps({"kind": kind, **key}, sort_keys=True)
    return folder / f"{kind}-{code_fingerprint()[:16]}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def _prune(folder: pathlib.Path) -> None:
    """Remove the entries another version of the code wrote (their fingerprint in the name is
    not ours): no run of this code can read them, so the folder does not grow with upgrades."""
    mine = f"-{code_fingerprint()[:16]}-"
    for entry in folder.glob("*.json"):
        if mine not in entry.name:
            with contextlib.suppress(OSError):  # another process pruned it first
                entry.unlink()


def load(kind: str, key: dict[str, Any]) -> Any | None:
    """The entry stored under ``key``, or None (no cache, no entry, or an unreadable one)."""
    path = _path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # torn by another writer or the disk: captured again
        return None


def store(kind: str, key: dict[str, Any], value: Any) -> bool:
    """Write ``value`` (JSON-ready) under ``key`` atomically; False where the folder cannot be
    written (planning goes on uncached)."""
    path = _path(kind, key)
    if path is None:
        return False
    tmp = None
    try:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not any(path.parent.glob(f"{kind}-{code_fingerprint()[:16]}-*.json")):
            _prune(path.parent)  # the first entry of a kind this code writes: clear the old ones
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        return False
    return True


__all__ = ["CACHE_ENV", "cache_dir", "code_fingerprint", "load", "store"]
