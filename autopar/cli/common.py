"""What the CLI's commands share: argument types, the plan flags, plan files, output helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.recompute_policy import ALLOWED_RECOMPUTE, is_recompute_name
from autopar.request import Constraints
from autopar.strategy import (
    COMPILE,
    GRAD_REDUCE,
    SCHEDULES,
    TP_OBJECTIVES,
)

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


def skew_factor(text: str) -> float:
    """argparse type: a finite number ≥ 1 (an imbalance: the busiest share over an even one)."""
    value = _number(text, allow_zero=False)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number ≥ 1 (1: balanced), got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a non-negative finite number (memory kept back)."""
    return _number(text, allow_zero=True)


def add_json_flag(p: argparse.ArgumentParser, what: str = "a table") -> None:
    p.add_argument("--json", action="store_true", help=f"print JSON instead of {what}")


def add_skew_flag(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    g.add_argument(
        "--expert-skew",
        type=skew_factor,
        default=1.0,
        help="MoE load imbalance to price expert-parallel plans with: routed rows on the busiest EP "
        "rank over an even share (default 1: balanced)",
    )


def add_constraint_flags(g: argparse._ArgumentGroup) -> None:
    """The plan knobs `autopar plan` and `autopar verify` share (None: the planner chooses)."""
    g.add_argument("--tp", type=positive, default=None, help="fix the tensor-parallel degree")
    g.add_argument("--pp", type=positive, default=None, help="fix the pipeline-parallel degree")
    g.add_argument("--dp", type=positive, default=None, help="fix the data-parallel degree")
    g.add_argument(
        "--ep",
        type=positive,
        default=None,
        help="fix the expert-parallel degree: each MoE layer's experts split over this many of the "
        "data-parallel ranks (1: replicated; default: the planner picks)",
    )
    add_skew_flag(g)
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None, help="fix the ZeRO stage")
    g.add_argument("--micro-batch", type=positive, default=None, help="fix the micro-batch size")
    g.add_argument("--schedule", choices=list(SCHEDULES), default=None)
    g.add_argument("--virtual-stages", type=positive, default=None, help="fix v (chunks per rank)")
    g.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force sequence parallelism on or off",
    )
    g.add_argument(
        "--tp-objective",
        choices=TP_OBJECTIVES,
        default=None,
        help="what the per-operator TP choice minimises (default: the planner prices both)",
    )
    g.add_argument(
        "--dp-replicate",
        type=positive,
        default=None,
        help="HSDP: replicate the model states over this many groups of the data-parallel ranks, "
        "ZeRO-sharded within each (1: no HSDP; default: the planner picks)",
    )
    add_grad_reduce_flag(g, "fix the dtype gradients are reduced in (default: the planner picks)")
    add_powersgd_flag(g, "fix PowerSGD's rank (0: off; default: the planner picks, with --allow-lossy-comm)")
    add_bucket_flag(
        g, "fix DDP's gradient bucket cap in MiB on plans that run on DDP (default: the planner picks)"
    )
    add_compile_flag(g, auto=True)
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


def add_grad_reduce_flag(g: Any, help_text: str, default: str | None = None) -> None:
    """--grad-reduce: the dtype of the data-parallel gradient reduction."""
    g.add_argument("--grad-reduce", choices=GRAD_REDUCE, default=default, help=help_text)


def add_powersgd_flag(g: Any, help_text: str, default: int | None = None) -> None:
    """--powersgd-rank: DDP's PowerSGD gradient compression (lossy)."""
    g.add_argument("--powersgd-rank", type=non_negative_int, default=default, help=help_text)


def add_bucket_flag(g: Any, help_text: str, default: float | None = None) -> None:
    """--bucket-mb: DDP's gradient bucket cap (``Strategy.bucket_mb``)."""
    g.add_argument("--bucket-mb", type=positive_float, default=default, help=help_text)


def add_compile_flag(g: Any, *, auto: bool) -> None:
    """--compile: eager, or each block compiled by torch.compile (``Strategy.compile``); with
    ``auto`` (the planner's flags) also ``auto``: the planner prices both."""
    choices = [*COMPILE, "auto"] if auto else list(COMPILE)
    g.add_argument(
        "--compile",
        choices=choices,
        default="off",
        help="off: eager kernels; block: torch.compile each block (fused kernels priced)"
        + ("; auto: the planner picks" if auto else "")
        + " (default off)",
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
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        ep=args.ep,
        expert_skew=args.expert_skew,
        zero=args.zero,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        sequence_parallel=args.sequence_parallel,
        tp_objective=args.tp_objective,
        recompute=allowed,
        grad_reduce=args.grad_reduce,
        dp_replicate=args.dp_replicate,
        powersgd_rank=args.powersgd_rank,
        bucket_mb=args.bucket_mb,
        compile=None if args.compile == "auto" else args.compile,
        allow_lossy_comm=args.allow_lossy_comm,
        **extra,
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
