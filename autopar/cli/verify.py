"""``autopar verify``: run a plan on local gloo processes against single-process training."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from autopar.cli.common import (
    DTYPES,
    add_constraint_flags,
    add_json_flag,
    constraints_from_args,
    positive,
    print_json,
    read_plan,
    spinner,
)
from autopar.errors import AutoparError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="run a plan on local gloo processes against single-process training")
    p.add_argument("model", metavar="MODEL", help="zoo name or factory returning a model with real weights")
    p.add_argument("--cluster", default="cpu", help="cluster preset or YAML (default cpu)")
    p.add_argument("--nproc", type=positive, default=2, help="local processes (default 2)")
    p.add_argument("--plan", default=None, help="a plan JSON (from autopar plan --out); else planned here")
    p.add_argument("--steps", type=positive, default=3, help="training steps to compare (default 3)")
    p.add_argument("--global-batch", type=positive, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=positive, default=32, help="sequence length (default 32)")
    p.add_argument(
        "--dtype",
        choices=[*DTYPES, "fp64"],
        default="fp32",
        help="the plan's training dtype (default fp32; fp32 and fp64 plans are checked in float64)",
    )
    add_constraint_flags(p.add_argument_group("plan options when no --plan is given (default: planned)"))
    p.add_argument(
        "--loss",
        default=None,
        help="module:fn or file.py:fn taking (model output, tokens) → scalar (default next-token CE)",
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "sgd"],
        default="adamw",
        help="adamw (default) or sgd: a parameter difference is then lr × a gradient difference "
        "(Adam's normalised step turns rounding in near-zero gradients into ±lr moves)",
    )
    p.add_argument(
        "--switch-at",
        type=positive,
        default=None,
        metavar="K",
        help="move the run to --switch-to's plan in process before step K (what autopar.Adaptive does)",
    )
    p.add_argument("--switch-to", default=None, metavar="PLAN", help="the plan JSON --switch-at moves to")
    add_json_flag(p, "text")


def cmd_verify(args: argparse.Namespace, console: Console) -> None:
    from autopar.groups import load_one_type
    from autopar.measure.ranks import resolve_loss
    from autopar.measure.verify import verify_plan
    from autopar.planner import ModelProfiles, make_plan
    from autopar.request import PlanRequest
    from autopar.zoo.registry import model_seq

    if (args.switch_at is None) != (args.switch_to is None):
        raise AutoparError("--switch-at K and --switch-to PLAN go together: give both or neither")
    switch = None if args.switch_at is None else (args.switch_at, read_plan(args.switch_to))
    dtype = "fp32" if args.dtype == "fp64" else args.dtype  # fp32 plans are checked in float64
    plan = read_plan(args.plan) if args.plan else None
    model_seq(args.model, plan.strategy.seq if plan else args.seq, dtype=dtype)  # within its positions
    profiles = ModelProfiles.of(args.model, dtype=dtype, seq=plan.strategy.seq if plan else args.seq)
    if plan is None:
        request = PlanRequest(
            model=args.model,
            cluster=load_one_type(args.cluster, what="planning in autopar verify", gpus_per_node=args.nproc),
            global_batch=args.global_batch,
            seq=args.seq,
            dtype=dtype,
            constraints=constraints_from_args(args),
        )
        plan = make_plan(request, profiles).plan
    if plan.strategy.powersgd_rank:
        raise AutoparError(
            f"verify checks equality with one process, which a PowerSGD plan (rank "
            f"{plan.strategy.powersgd_rank}: every gradient matrix approximated) does not have; verify "
            "the plan with --powersgd-rank 0 and judge PowerSGD by its loss curve"
        )
    if args.loss:
        resolve_loss(args.loss)  # a bad --loss is a user error here, not in every worker

    with spinner(args, f"running {plan.strategy.world_size} processes and the single-process reference …"):
        report = verify_plan(
            args.model,
            plan,
            nproc=args.nproc,
            steps=args.steps,
            vocab=profiles.base.vocab,
            loss_spec=args.loss,
            optimizer=args.optimizer,
            switch=switch,
        )
    if args.json:
        print_json({"plan": plan.to_dict(), **report.to_dict()})
    else:
        _print_verdict(console, plan, report, switch)
    if not report.passed:
        raise SystemExit(1)


def _print_verdict(console: Console, plan: Any, report: Any, switch: tuple[int, Any] | None) -> None:
    """The verdict as text: the plan(s), each step's losses, the errors against their bounds."""
    console.print(plan.text())
    if switch is not None:
        console.print(f"before step {switch[0]} the run moves in process to:\n{switch[1].text()}")
    for i, (a, b) in enumerate(zip(report.losses, report.reference_losses, strict=True)):
        console.print(f"step {i}: loss {a:.6f}  reference {b:.6f}  diff {abs(a - b):.2e}")
    loss_b, grad_b, param_b = report.bounds
    if report.dropout:
        console.print(f"the model draws dropout masks: {report.dropout}")
    console.print(
        f"checked in {report.arithmetic}: gradients within {report.max_grad_error:.1e} of their norm "
        f"(bound {grad_b:.1e}), parameters within {report.max_param_error:.1e} of their update "
        f"(bound {param_b:.1e}), losses within {report.max_loss_error:.1e} (bound {loss_b:.1e}): "
        + ("PASS" if report.passed else f"FAIL: {report.first_failure}")
    )


__all__ = ["add_parser", "cmd_verify"]
