"""Parsing and printing of quantities with units (bytes, bytes/s, FLOP/s, seconds).

Cluster YAML files may give ``memory_bytes: 80 GB`` or ``latency_s: 5 us`` as
well as plain numbers. Decimal prefixes are powers of 1000, binary prefixes
(``KiB``, ``MiB``, ``GiB``, ``TiB``) powers of 1024.
"""

from __future__ import annotations

import re

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

# Unit suffix accepted for each kind of quantity (after the prefix).
_SUFFIX = {
    "bytes": ("B",),
    "bytes_per_s": ("B/s",),
    "flops": ("FLOP/s", "FLOPS", "flop/s"),
}

_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"


def parse_quantity(value: object, kind: str, field: str) -> float:
    """Return ``value`` as a float in base units of ``kind``.

    ``kind`` is one of ``bytes``, ``bytes_per_s``, ``flops``, ``seconds``.
    Plain numbers are taken as base units. Raises ``ValueError`` naming
    ``field`` and the expected form when the value can't be read.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a number, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected a number, got {type(value).__name__} {value!r}")
    text = value.strip()
    m = re.fullmatch(_NUMBER + r"\s*(.*)", text)
    if m is None:
        raise ValueError(f"{field}: expected a number with a unit, got {value!r}")
    number, unit = float(m.group(1)), m.group(2).strip()
    if unit == "":
        return number
    if kind == "seconds":
        if unit in _TIME:
            return number * _TIME[unit]
        raise ValueError(f"{field}: unknown time unit {unit!r} in {value!r}; use s, ms, us or ns")
    for suffix in _SUFFIX[kind]:
        if unit.endswith(suffix):
            prefix = unit[: -len(suffix)]
            if prefix in _DECIMAL:
                return number * _DECIMAL[prefix]
            if prefix in _BINARY:
                return number * _BINARY[prefix]
    example = {"bytes": "80 GB", "bytes_per_s": "400 GB/s", "flops": "989 TFLOP/s"}[kind]
    raise ValueError(f"{field}: can't read the unit of {value!r}; write it like {example!r}")


def format_bytes(n: float) -> str:
    """``format_bytes(85899345920) == '80.0 GiB'`` (binary prefixes, as allocators report)."""
    for unit, scale in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_si(n: float, unit: str) -> str:
    """``format_si(9.89e14, 'FLOP/s') == '989 TFLOP/s'`` (decimal prefixes)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"
