"""``autopar dryrun``: every distinct rank's real program at the plan's world size, on this CPU
(``measure.dryrun``), its memory next to the cost model's and its collectives per mesh axis."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.cli.common import (
    CLUSTER_HELP,
    DTYPES,
    MODEL_HELP,
    add_constraint_flags,
    add_json_flag,
    constraints_from_args,
    positive,
    print_json,
    progress,
    read_plan,
)
from autopar.errors import AutoparError
from autopar.units import format_bytes


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "dryrun", help="build and step each rank's real program at full scale on this CPU (fake tensors)"
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--plan", default=None, help="a plan JSON (from autopar plan --out); else planned here")
    p.add_argument("--cluster", default=None, help=CLUSTER_HELP + " (to plan here)")
    p.add_argument("--nodes", type=positive, default=None, help="number of nodes (default 1)")
    p.add_argument("--global-batch", type=positive, default=None, help="sequences per step (to plan here)")
    p.add_argument("--seq", type=positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument(
        "--ranks",
        default="distinct",
        help="which ranks: distinct (first, middle and last pipeline rank; default), all, or R,R,…",
    )
    p.add_argument(
        "--steps",
        type=positive,
        default=1,
        help="training steps after the optimizer's state is made, the last measured (default 1)",
    )
    add_json_flag(p, "a table")
    add_constraint_flags(p.add_argument_group("plan options when no --plan is given (default: planned)"))


def _ranks(text: str, plan: Any) -> list[int]:
    from autopar.measure.dryrun import rank_roles

    world = plan.strategy.world_size
    if text == "distinct":
        return [r for r, _ in rank_roles(plan)]
    if text == "all":
        return list(range(world))
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AutoparError(f"--ranks takes distinct, all or comma-separated ranks, got {text!r}") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise AutoparError(f"--ranks {text!r}: the plan's ranks are 0…{world - 1}")
    return ranks


def _plan(args: argparse.Namespace) -> Any:
    if args.plan:
        return read_plan(args.plan)
    if args.cluster is None or args.global_batch is None:
        raise AutoparError("give --plan plan.json, or --cluster and --global-batch to plan here")
    from autopar.groups import load_one_type
    from autopar.planner import make_plan
    from autopar.request import PlanRequest
    from autopar.zoo.registry import model_seq

    request = PlanRequest(
        model=args.model,
        cluster=load_one_type(args.cluster, what="autopar dryrun", nodes=args.nodes),
        global_batch=args.global_batch,
        seq=model_seq(args.model, args.seq, dtype=args.dtype),
        dtype=args.dtype,
        constraints=constraints_from_args(args),
    )
    progress(args, f"planning {args.model} …")
    return make_plan(request).plan


def cmd_dryrun(args: argparse.Namespace, console: Console) -> None:
    from autopar.measure.dryrun import dry_run
    from autopar.zoo.spec import build_model, load_factory

    plan = _plan(args)
    if ":" in args.model:
        load_factory(args.model)  # a bad MODEL is one line here, not a failed rank
    make = functools.partial(build_model, args.model)
    runs = []
    for rank in _ranks(args.ranks, plan):
        progress(args, f"dry-running rank {rank} of {plan.strategy.world_size} …")
        runs.append(dry_run(make, plan, rank, steps=args.steps))
    if args.json:
        print_json({"plan": plan.to_dict(), "ranks": [r.to_dict() for r in runs]})
    else:
        _print(console, plan, runs)
    failed = [r for r in runs if not r.ok]
    if failed:
        raise AutoparError(f"rank {failed[0].rank} ({failed[0].role}): {failed[0].failure}")


def check(args: argparse.Namespace, plan: Any) -> list[dict[str, Any]]:
    """``autopar plan --check``: each distinct rank of ``plan`` dry-run; per rank its figures and
    whether its program built and its peak, with the cost model's reserve, fits the memory the
    plan had (``predicted["memory_capacity_bytes"]``)."""
    from autopar.measure.dryrun import dry_run, rank_roles
    from autopar.zoo.spec import build_model

    capacity = plan.predicted["memory_capacity_bytes"]
    make = functools.partial(build_model, args.model)
    out = []
    for rank, _ in rank_roles(plan):
        progress(args, f"dry-running rank {rank} of {plan.strategy.world_size} …")
        run = dry_run(make, plan, rank)
        need = run.peak_bytes + run.predicted.get("reserve", 0.0)
        out.append({**run.to_dict(), "needs_bytes": need, "fits": run.ok and need <= capacity})
    return out


def check_top(
    args: argparse.Namespace, request: Any, profiles: Any, result: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """``autopar plan --check K``: the chosen plan, then its runners-up (each planned again with
    its knobs pinned, ``request.pinned``), dry-run in order of predicted speed until one builds
    and fits on every distinct rank; that plan, and per plan tried its ranks and verdict. Raises
    ``AutoparError`` (one line: the first plan's verdict) when none of the K does."""
    from autopar.planner import make_plan
    from autopar.request import pinned

    tried: list[dict[str, Any]] = []
    alternatives = [None, *result.alternatives[: args.check - 1]]
    for i, alt in enumerate(alternatives):
        if alt is None:
            plan = result.plan
        else:
            progress(args, f"planning runner-up {i} with its knobs pinned …")
            plan = make_plan(pinned(request, alt.strategy), profiles).plan
        ranks = check(args, plan)
        verdict = check_verdict(ranks, plan.predicted["memory_capacity_bytes"])
        strategy = plan.strategy.to_dict()
        tried.append(
            {"runner_up": i, "hash": plan.hash, "strategy": strategy, "ranks": ranks, "verdict": verdict}
        )
        if not verdict:
            return plan, tried
    first = tried[0]["verdict"]
    more = f"; so did its {len(tried) - 1} runner(s)-up" if len(tried) > 1 else ""
    raise AutoparError(first + more)


def check_verdict(checked: list[dict[str, Any]], capacity: float) -> str:
    """One line on the first rank whose dry run failed or did not fit ("" when all did)."""
    bad = next((c for c in checked if not c["fits"]), None)
    if bad is None:
        return ""
    where = f"the plan's dry run: rank {bad['rank']} ({bad['role']})"
    if bad["failure"]:
        return f"{where}: {bad['failure']}"
    return (
        f"{where} needs {format_bytes(bad['needs_bytes'])} with the reserve, over the "
        f"{format_bytes(capacity)} per GPU (the cost model predicted "
        f"{format_bytes(bad['predicted'].get('peak_bytes', 0.0))}); constrain it (--memory-cap-gib, "
        "--recompute full, a smaller --micro-batch) and plan again"
    )


def _print(console: Console, plan: Any, runs: list[Any]) -> None:
    console.print(plan.text().splitlines()[0])
    table = Table(show_edge=False, title="memory per rank: dry run vs cost model (without its reserve)")
    for col in ("rank", "holds", "peak", "predicted", "ratio", "params", "optimizer", "grads", "seconds"):
        table.add_column(col, justify="left" if col == "holds" else "right")
    for r in runs:
        if not r.ok:
            table.add_row(str(r.rank), r.role, "failed", "", "", "", "", "", "")
            continue
        ratio = r.peak_bytes / r.predicted_peak_bytes if r.predicted_peak_bytes > 0 else float("nan")
        table.add_row(
            str(r.rank),
            r.role,
            format_bytes(r.peak_bytes),
            format_bytes(r.predicted_peak_bytes),
            f"{ratio:.2f}",
            format_bytes(r.parameter_bytes),
            format_bytes(r.optimizer_bytes),
            format_bytes(r.gradient_bytes),
            f"{r.seconds:.1f}",
        )
    console.print(table)
    for r in runs:
        if r.ok and r.collectives:
            parts = [f"{k} {n}× {format_bytes(b)}" for k, (n, b) in r.collectives.items()]
            console.print(f"rank {r.rank} collectives of a step: " + "; ".join(parts))


__all__ = ["add_parser", "check", "check_top", "check_verdict", "cmd_dryrun"]
