"""Names a package re-exports, imported on first use (PEP 562): the package ``__init__``s whose
names need torch (``autopar``, ``autopar.graph``, ``autopar.zoo``) stay cheap to import, so a
plan read from the capture cache (``autopar.cache``) never imports torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: a name of ``homes`` (name → the module that
    defines it) is imported from its module the first time it is read, then kept on the package."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__all__ = ["lazy_attributes"]
