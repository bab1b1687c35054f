"""Checked fields of the YAML and JSON specs (cluster files): each failure is one
``ClusterSpecError`` that names the field, what was expected and what was given."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import yaml

from autopar.errors import ClusterSpecError
from autopar.units import parse_quantity


def is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check(ok: bool, field: str, expected: str, got: object = dataclasses.MISSING) -> None:
    if not ok:
        suffix = "" if got is dataclasses.MISSING else f", got {got!r}"
        raise ClusterSpecError(f"{field}: expected {expected}{suffix}")


def check_positive(x: object, field: str) -> None:
    check(is_number(x) and x > 0, field, "a positive number", x)  # type: ignore[operator]


def check_positive_int(x: object, field: str) -> None:
    check(isinstance(x, int) and not isinstance(x, bool) and x > 0, field, "a positive integer", x)


def require(d: Mapping[str, Any], key: str, prefix: str) -> Any:
    if key not in d:
        raise ClusterSpecError(f"{prefix}{key}: missing (required field)")
    return d[key]


def reject_unknown(d: Mapping[str, Any], known: set[str], prefix: str) -> None:
    unknown = sorted(set(d) - known - {"preset"})
    if unknown:
        raise ClusterSpecError(
            f"{prefix}{unknown[0]}: unknown field; expected one of {', '.join(sorted(known))}"
        )


def mapping(x: object, field: str) -> Mapping[str, Any]:
    check(isinstance(x, Mapping), field, "a mapping of fields", x)
    return x  # type: ignore[return-value]


def string(x: object, field: str) -> str:
    check(isinstance(x, str), field, "a string", x)
    return x  # type: ignore[return-value]


def positive_int(x: object, field: str) -> int:
    check_positive_int(x, field)
    return x  # type: ignore[return-value]


def number(x: object, field: str) -> float:
    check(is_number(x), field, "a number", x)
    return float(x)  # type: ignore[arg-type]


def quantity_of(x: object, kind: str, field: str, example: str) -> float:
    try:
        return parse_quantity(x, kind, field)
    except ValueError as e:
        raise ClusterSpecError(f"{e} (e.g. {example!r})") from None


def quantity(d: Mapping[str, Any], key: str, kind: str, prefix: str, example: str) -> float:
    return quantity_of(require(d, key, prefix), kind, prefix + key, example)


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | os.PathLike[str], what: str) -> Any:
    """``path``'s YAML (None when empty); a missing, unreadable or malformed file is one line
    naming ``what`` and the file (for a parse error: where, and what PyYAML found)."""
    name = os.fspath(path)
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise ClusterSpecError(f"{what} {name!r} does not exist") from None
    except IsADirectoryError:
        raise ClusterSpecError(f"{what} {name!r} is a directory; give a YAML file") from None
    except OSError as e:
        raise ClusterSpecError(f"can't read {what} {name!r}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ClusterSpecError(f"{what} {name!r} is not valid YAML{where}: {problem}") from None
