"""Files autopar writes (plans, profiles): checked before the work, written atomically."""

from __future__ import annotations

import contextlib
import os

from autopar.errors import AutoparError


def check_writable(path: str | os.PathLike[str], what: str = "--out") -> None:
    """Fail at once, before any work, when ``path`` can't become a file: a directory, or in a
    folder that does not exist."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise AutoparError(f"{what} {path!r} is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise AutoparError(f"{what} {path!r}: the folder {folder!r} does not exist")


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` through a temporary file and a rename: never
    half-written, and no temporary file left behind when it fails."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise AutoparError(f"can't write {path!r}: {e.strerror or e}") from None


__all__ = ["check_writable", "write_atomic"]
