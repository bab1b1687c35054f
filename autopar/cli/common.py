"""What the CLI's commands share: argument types, the plan flags, plan files, output helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

from rich.console import Console

from autopar.errors import AutoparError
from autopar.knobs import Knob, knobs
from autopar.plan import Plan
from autopar.recompute_policy import ALLOWED_RECOMPUTE, is_recompute_name
from autopar.request import Constraints
from autopar.strategy import Strategy

MODEL_HELP = "zoo name, path/to/file.py:factory or pkg.mod:factory"
CLUSTER_HELP = "preset name (see `autopar clusters`) or YAML file"
DTYPES = ["bf16", "fp16", "fp32"]


def positive(text: str) -> int:
    """argparse type: a positive integer."""
    return _integer(text, least=1)


def non_negative_int(text: str) -> int:
    """argparse type: a non-negative integer (0: off)."""
    return _integer(text, least=0)


def _integer(text: str, *, least: int) -> int:
    kind = "positive" if least == 1 else "non-negative"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {value}")
    return value


def _number(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 if allow_zero else value > 0) or value != value or value == float("inf"):
        kind = "non-negative" if allow_zero else "positive"
        raise argparse.ArgumentTypeError(f"expected a {kind} finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a positive finite number (a time limit, a memory cap)."""
    return _number(text, allow_zero=False)


def non_negative_float(text: str) -> float:
    """argparse type: a non-negative finite number (memory kept back)."""
    return _number(text, allow_zero=True)


def add_json_flag(p: argparse.ArgumentParser, what: str = "a table") -> None:
    p.add_argument("--json", action="store_true", help=f"print JSON instead of {what}")


def _flag_type(k: Knob) -> dict[str, Any]:
    """argparse's ``type``/``choices``/``action`` for a knob (``autopar.knobs.Knob``)."""
    if k.kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if k.choices:
        return {"type": k.kind, "choices": list(k.choices)}
    if k.kind is int:
        return {"type": non_negative_int if k.least == 0 else positive}
    if k.least == 0:
        return {"type": positive_float}
    if k.least is not None:
        least = k.least
        return {"type": lambda text: _at_least(text, least)}
    return {"type": float}


def _at_least(text: str, least: float) -> float:
    """argparse type: a finite number ≥ ``least``."""
    value = _number(text, allow_zero=False)
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a number ≥ {least:g}, got {text}")
    return value


def add_knob_flags(g: Any, *, fixing: bool, cls: type = Strategy) -> None:
    """A flag per knob the user may fix (``Knob.fixable``), made from ``Strategy``'s
    declarations: ``fixing`` (``plan``, ``verify``): default None, the planner picks (``auto``
    where the knob has a value it keeps unless told); else (``estimate``): the field's default,
    or what ``Strategy.for_world`` derives. ``cls``: whose knobs (``Strategy``'s)."""
    defaults = {f.name: f.default for f in fields(cls)}
    for name, k in knobs(cls).items():
        if not k.fixable:
            continue
        kw = _flag_type(k)
        if fixing and k.auto:
            kw["choices"] = [*kw["choices"], "auto"]
            help_text, default = f"{k.help} (default {k.free}; auto: the planner picks)", k.free
        elif fixing:
            default = k.free
            help_text = f"fix the {k.help} (default: " + (
                "the planner picks)" if k.free is None else f"{k.free:g})"
            )
        else:
            default = None if k.derived else defaults[name]
            help_text = f"{k.help} (default: {k.derived or _shown(defaults[name])})"
        g.add_argument(
            f"--{name.replace('_', '-')}", default=default, help=help_text.replace("%", "%%"), **kw
        )


def _shown(value: Any) -> str:
    """A default as --help shows it."""
    return (
        ("on" if value else "off")
        if isinstance(value, bool)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def knob_values(args: argparse.Namespace) -> dict[str, Any]:
    """The knob flags' values (``add_knob_flags``) by field name; ``auto`` → None."""
    return {
        name: None if getattr(args, name) == "auto" else getattr(args, name)
        for name, k in knobs(Strategy).items()
        if k.fixable
    }


def add_constraint_flags(g: argparse._ArgumentGroup) -> None:
    """The plan knobs `autopar plan` and `autopar verify` share (None: the planner chooses)."""
    add_knob_flags(g, fixing=True)
    g.add_argument(
        "--allow-lossy-comm",
        action="store_true",
        help="let the planner pick communication that drops precision the dtype keeps (bf16 "
        "gradient reduction of an fp32 or fp16 plan)",
    )
    g.add_argument(
        "--recompute",
        default=",".join(ALLOWED_RECOMPUTE),
        help="recompute choices allowed per block, comma-separated: none, selective, full, sac (every "
        "per-operator policy) or one policy such as sac2 (default none,selective,sac,full)",
    )


def add_measured_flags(p: argparse.ArgumentParser) -> None:
    """--profile / --comm: measured numbers in place of the cluster's analytic ones."""
    p.add_argument("--profile", default=None, help="compute profile JSON from `autopar profile`")
    p.add_argument("--comm", default=None, help="collective fits JSON from `autopar profile-comm`")


def constraints_from_args(args: argparse.Namespace, **extra: Any) -> Constraints:
    """The planner's Constraints from the shared plan flags (``add_constraint_flags``)."""
    allowed = tuple(x.strip() for x in args.recompute.split(",") if x.strip())
    if not allowed or not all(is_recompute_name(x) for x in allowed):
        raise AutoparError(
            f"--recompute takes a comma-separated subset of {', '.join(ALLOWED_RECOMPUTE)} or policy "
            f"names (sac1, sac2, …), got {args.recompute!r}"
        )
    return Constraints(
        **knob_values(args), recompute=allowed, allow_lossy_comm=args.allow_lossy_comm, **extra
    )


def read_plan(path: str) -> Plan:
    """A plan file written by `autopar plan --out` (or the whole `autopar plan --json` output,
    which holds it under "plan"); anything else is a one-line user error."""
    try:
        with open(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return Plan.from_json(text)  # says where the JSON breaks, in one line
        if isinstance(data, dict) and isinstance(data.get("plan"), dict) and "strategy" not in data:
            data = data["plan"]
        return Plan.from_dict(data)
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError, AutoparError) as e:
        raise AutoparError(f"can't read plan {path!r}: {e}") from None


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def progress(args: argparse.Namespace, message: str) -> None:
    """A progress line on stderr, for people at a terminal (never in --json or piped runs)."""
    if not args.json and sys.stderr.isatty():
        Console(stderr=True).print(f"[dim]{message}[/dim]")


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[int, int, str], None] | None]:
    """A transient progress bar on stderr (when ``enabled`` and at a terminal: never in --json or
    piped runs), as a (done, total, what) callback; None otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("starting", total=1)

        def update(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        yield update


@contextlib.contextmanager
def spinner(args: argparse.Namespace, message: str) -> Iterator[None]:
    """A spinner with ``message`` on stderr while the work runs (at a terminal, not --json)."""
    if args.json or not sys.stderr.isatty():
        yield
        return
    with Console(stderr=True).status(f"[dim]{message}[/dim]"):
        yield


def count(n: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f}"
