"""Each knob declared once: a ``Strategy`` field carries its ``Knob`` (type, bounds, choices,
the help its flags print, whether the user may fix it), and what repeated it by hand before is
made from that — the checks of ``Strategy`` and ``Constraints`` (``problem``), the fields of
``Constraints`` that fix a knob (``constraint_fields``), and the flags of ``autopar plan``,
``verify`` and ``estimate`` (``cli.common.add_knob_flags``).

Adding a knob: a field of ``Strategy`` declared with ``knob(...)``, its price in
``cost_models/``, its apply step in ``runtime/`` (and, for the planner to choose it, its
choices in ``planner/search.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Knob:
    """What a ``Strategy`` field is, beyond its Python type and docstring."""

    kind: type
    """int, float, bool or str (a choice)."""
    help: str
    """What it is, for --help: a noun phrase ("tensor-parallel degree")."""
    least: float | None = None
    """Smallest value allowed (int and float knobs; a float's 0 means above 0); None: any."""
    choices: tuple[Any, ...] = ()
    """The values allowed (str knobs, and ints such as ZeRO's stages); empty: any."""
    fixable: bool = True
    """The user may fix it: a ``Constraints`` field (None: the planner picks) and a flag of
    ``plan``, ``verify`` and ``estimate``."""
    free: Any = None
    """The ``Constraints`` default: None (the planner picks), or a value the plan keeps unless
    told (``compile``: off, as compiling costs minutes; ``expert_skew``: 1, balanced)."""
    auto: bool = False
    """A flag value ``auto`` means None: the planner picks (knobs whose ``free`` is not None)."""
    unit: str = ""
    """What a number counts ("MiB"), for messages."""
    derived: str = ""
    """What ``estimate`` uses when the flag is not given, where it is not the field's default
    (``Strategy.for_world`` derives it: dp from the world, v from the schedule)."""

    def problem(self, name: str, value: Any, *, or_none: bool = False) -> str:
        """Why ``value`` is no value of this knob, in one line ("" when it is one); ``or_none``:
        the message says None is allowed too (a constraint left free)."""
        why = self._problem(name, value)
        return why.replace(", got", " or None, got", 1) if why and or_none else why

    def _problem(self, name: str, value: Any) -> str:
        if self.kind is bool:
            return "" if isinstance(value, bool) else f"{name} must be true or false, got {value!r}"
        if self.choices:
            if value in self.choices and isinstance(value, self.kind) and not isinstance(value, bool):
                return ""
            return f"{name} must be one of {', '.join(map(str, self.choices))}, got {value!r}"
        if self.kind is str:
            return "" if isinstance(value, str) else f"{name} must be a name, got {value!r}"
        numeric = int if self.kind is int else int | float
        if isinstance(value, bool) or not isinstance(value, numeric) or not -math.inf < value < math.inf:
            return f"{name} must be {self.describe_range()}, got {value!r}"
        low = self.least
        if low is not None and (value < low or (self.kind is float and low == 0 and value == 0)):
            return f"{name} must be {self.describe_range()}, got {value!r}"
        return ""

    def describe_range(self) -> str:
        """ "a positive integer", "a number ≥ 1", …"""
        if self.kind is int:
            return {1: "a positive integer", 0: "a non-negative integer"}.get(
                int(self.least) if self.least is not None else -1, "an integer"
            )
        unit = f" of {self.unit}" if self.unit else ""
        if self.least is None:
            return f"a finite number{unit}"
        return f"a positive number{unit}" if self.least <= 0 else f"a number{unit} ≥ {self.least:g}"


def knob(default: Any, **knob_fields: Any) -> Any:
    """A ``Strategy`` field with its ``Knob``: ``tp: int = knob(1, kind=int, least=1, help=…)``."""
    return dataclasses.field(default=default, metadata={"knob": Knob(**knob_fields)})


def knobs(cls: type) -> dict[str, Knob]:
    """The knobs of dataclass ``cls`` by field name, in declaration order."""
    return {f.name: f.metadata["knob"] for f in dataclasses.fields(cls) if "knob" in f.metadata}


def field_problem(cls: type, obj: Any) -> str:
    """The first of ``obj``'s knob fields (the knobs of ``cls``) that holds no value of its knob,
    in one line ("" when all do)."""
    for name, k in knobs(cls).items():
        if why := k.problem(name, getattr(obj, name)):
            return why
    return ""


def constraint_fields(cls: type) -> list[tuple[str, Any, Any]]:
    """``make_dataclass`` fields of the knobs of ``cls`` the user may fix: each ``T | None``,
    defaulting to its ``free`` value, its knob in the metadata, fixed-first order as declared."""
    out = []
    for f in dataclasses.fields(cls):
        k = f.metadata.get("knob")
        if k is not None and k.fixable:
            optional = k.free is None or k.auto  # None: the planner picks
            kind = f"{k.kind.__name__} | None" if optional else k.kind.__name__
            out.append((f.name, kind, dataclasses.field(default=k.free, metadata={"knob": k})))
    return out


def constraint_problem(cls: type, obj: Any) -> str:
    """The first fixed knob of constraints ``obj`` (the fixable knobs of ``cls``) holding no
    value of its knob, or None where the knob has a value to keep (``free``), in one line."""
    for name, k in knobs(cls).items():
        value = getattr(obj, name, None)
        optional = k.free is None or k.auto
        if not k.fixable or (value is None and optional):
            continue
        if why := k.problem(name, value, or_none=optional):
            return why
    return ""


__all__ = ["Knob", "constraint_fields", "constraint_problem", "field_problem", "knob", "knobs"]
