"""The ``autopar plan`` and ``autopar verify`` commands (split from cli.py, which dispatches)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.cli_common import progress
from autopar.errors import AutoparError
from autopar.units import format_bytes

RECOMPUTE_DEFAULT = "none,selective,full"


def constraints_from_args(args: argparse.Namespace, **extra: Any) -> Any:
    """The planner's Constraints from the shared plan flags (see cli._add_constraint_flags)."""
    from autopar.cost_models.strategy import RECOMPUTE
    from autopar.planner import Constraints

    allowed = tuple(x.strip() for x in args.recompute.split(",") if x.strip())
    if not allowed or any(x not in RECOMPUTE for x in allowed):
        raise AutoparError(
            f"--recompute takes a comma-separated subset of {', '.join(RECOMPUTE)}, got {args.recompute!r}"
        )
    return Constraints(
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        zero=args.zero,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        sequence_parallel=args.sequence_parallel,
        tp_objective=args.tp_objective,
        recompute=allowed,
        **extra,
    )


def cmd_plan(args: argparse.Namespace, console: Console) -> None:
    from autopar.cluster import Cluster
    from autopar.costing import profile_fn
    from autopar.models import resolve
    from autopar.planner import make_plan

    cluster = Cluster.load(args.cluster, nodes=args.nodes).from_profile(compute=args.profile, comm=args.comm)
    seq = args.seq or resolve(args.model, dtype=args.dtype).default_seq
    constraints = constraints_from_args(
        args, memory_cap_bytes=args.memory_cap_gib * 2**30 if args.memory_cap_gib else None
    )
    progress(args, f"capturing {args.model} at seq {seq} …")
    profile_at = profile_fn(args.model, dtype=args.dtype, seq=seq)
    profile_at(1)
    profile_at(2)  # the two captures every micro-batch size is derived from
    progress(args, "planning …")
    result = make_plan(
        args.model,
        profile_at,
        cluster,
        global_batch=args.global_batch,
        seq=seq,
        dtype=args.dtype,
        constraints=constraints,
        top_k=args.top,
        time_limit_s=args.time_limit,
    )
    plan = result.plan
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write(plan.to_json())
        os.replace(tmp, args.out)
    best = plan.predicted["step_time_s"]
    alternatives = [_candidate_dict(c, best) for c in result.alternatives]
    baselines = {k: (_candidate_dict(c, best) if c else None) for k, c in result.baselines.items()}
    if args.json:
        st = plan.strategy
        print(
            json.dumps(
                {
                    "model": args.model,
                    "cluster": cluster.name,
                    "nodes": cluster.num_nodes,
                    "plan": {
                        "tp": st.tp,
                        "pp": st.pp,
                        "dp": st.dp,
                        "zero": st.zero,
                        "micro_batch": st.micro_batch,
                        "num_microbatches": st.micro_batches,
                        "schedule": st.schedule,
                        "virtual_stages": st.virtual_stages,
                        "sequence_parallel": st.sequence_parallel,
                        "tp_objective": st.tp_objective,
                        "dtype": st.dtype,
                        "mesh": [list(a) for a in plan.mesh],
                        "crosses_nodes": list(plan.crosses_nodes),
                        "stages": [
                            {
                                "index": s.index,
                                "layers": list(s.layers),
                                "recompute": {b: r for b, r in s.recompute},
                            }
                            for s in plan.stages
                        ],
                        "hash": plan.hash,
                        "tensor_parallel": {
                            ltype: [{"op": k, "strategy": n, "output": o} for k, n, o in ops]
                            for ltype, ops in plan.tensor_parallel
                        },
                    },
                    "predicted": plan.predicted,
                    "alternatives": alternatives,
                    "baselines": baselines,
                    "solve_time_s": result.solve_time_s,
                    "optimality_gap": plan.optimality_gap,
                    "ilps_solved": result.ilps_solved,
                    "outer_candidates": result.outer_candidates,
                },
                indent=2,
            )
        )
        return
    _print_plan(console, plan, result, alternatives, baselines, cluster)
    if args.out:
        console.print(f"[dim]plan written to {args.out}[/dim]")


def _candidate_dict(c: Any, best: float) -> dict[str, Any]:
    st = c.strategy
    return {
        "tp": st.tp,
        "pp": st.pp,
        "dp": st.dp,
        "zero": st.zero,
        "micro_batch": st.micro_batch,
        "schedule": st.schedule,
        "virtual_stages": st.virtual_stages,
        "sequence_parallel": st.sequence_parallel,
        "tp_objective": st.tp_objective,
        "layout": [list(x) for x in st.layout],
        "recompute": st.recompute,
        "step_time_s": c.estimate.step_time_s,
        "tflops_per_gpu": c.estimate.tflops_per_gpu,
        "fits": c.estimate.fits,
        "slower_by": c.estimate.step_time_s / best,
    }


def _print_plan(
    console: Console,
    plan: Any,
    result: Any,
    alternatives: list[dict[str, Any]],
    baselines: dict[str, Any],
    cluster: Any,
) -> None:
    pred = plan.predicted
    lines = plan.text().splitlines()
    console.print(lines[0])
    console.print(lines[1])
    for line in lines:  # per-operator tensor-parallel strategies of each block type
        if line.startswith("tensor parallel "):
            console.print(line)
    table = Table(title="stages", show_edge=False, title_justify="left")
    cols = (
        "stage",
        "layers",
        "recompute",
        "time/micro-batch",
        "of which TP comm",
        "states",
        "activations",
        "other",
        "peak",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("layers", "recompute") else "right")
    capacity = format_bytes(pred["memory_capacity_bytes"])
    for s, mem in zip(plan.stages, pred["memory"], strict=True):
        states = mem["weights"] + mem["gradients"] + mem["optimizer"]
        other = mem["loss"] + mem["comm_buffers"] + mem["reserve"]
        table.add_row(
            str(s.index),
            f"{s.layers[0]} … {s.layers[-1]} ({len(s.layers)})",
            s.recompute_summary,
            f"{1e3 * s.time_per_micro_batch_s:.1f} ms",
            f"{1e3 * s.comm_per_micro_batch_s:.1f} ms",
            format_bytes(states),
            format_bytes(mem["activations"]),
            format_bytes(other),
            f"{format_bytes(mem['peak_bytes'])} / {capacity}",
        )
    console.print(table)
    console.print(
        f"predicted: {pred['step_time_s']:.3f} s/step · {pred['tokens_per_s']:,.0f} tokens/s · "
        f"{pred['tflops_per_gpu']:.1f} TFLOP/s per GPU (MFU {100 * pred['mfu']:.1f}%, "
        f"HFU {100 * pred['hfu']:.1f}%)"
    )
    for note in pred.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")
    console.print(
        f"solved in {result.solve_time_s:.2f} s: {result.ilps_solved} layout ILPs over "
        f"{result.outer_candidates} outer choices; proven gap {100 * plan.optimality_gap:.2f}%"
    )
    why = Table(
        title="why this plan: runners-up and baselines (same cost model)",
        show_edge=False,
        title_justify="left",
    )
    for col in ("", "tp", "pp", "dp", "zero", "micro-batch", "schedule", "step s", "vs chosen"):
        why.add_column(col, justify="left" if col in ("", "schedule") else "right")

    def row(label: str, c: dict[str, Any] | None) -> None:
        if c is None:
            why.add_row(label, *["-"] * 6, "does not fit", "")
            return
        sched = c["schedule"] + (f" v={c['virtual_stages']}" if c["virtual_stages"] > 1 else "")
        why.add_row(
            label,
            str(c["tp"]),
            str(c["pp"]),
            str(c["dp"]),
            str(c["zero"]),
            str(c["micro_batch"]),
            sched,
            f"{c['step_time_s']:.3f}",
            f"{c['slower_by']:.2f}× slower",
        )

    for i, c in enumerate(alternatives, 1):
        row(f"runner-up {i}", c)
    for name, c in baselines.items():
        row(name, c)
    console.print(why)


def cmd_verify(args: argparse.Namespace, console: Console) -> None:
    from autopar.cluster import Cluster
    from autopar.costing import profile_fn
    from autopar.plan import Plan
    from autopar.planner import make_plan
    from autopar.verify import verify_plan

    if args.plan:
        try:
            with open(args.plan) as f:
                plan = Plan.from_json(f.read())
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError, AutoparError) as e:
            raise AutoparError(f"can't read plan {args.plan!r}: {e}") from None
    else:
        cluster = Cluster.load(args.cluster, gpus_per_node=args.nproc)
        constraints = constraints_from_args(args)
        plan = make_plan(
            args.model,
            profile_fn(args.model, dtype=args.dtype, seq=args.seq),
            cluster,
            global_batch=args.global_batch,
            seq=args.seq,
            dtype=args.dtype,
            constraints=constraints,
        ).plan
    progress(args, f"running {plan.strategy.world_size} processes and the single-process reference …")
    vocab = profile_fn(args.model, dtype=args.dtype, seq=plan.strategy.seq)(1).vocab
    if args.loss:
        from autopar.verify import resolve_loss

        resolve_loss(args.loss)  # a bad --loss is a user error here, not in every worker
    report = verify_plan(
        args.model,
        plan,
        nproc=args.nproc,
        steps=args.steps,
        vocab=vocab,
        loss_spec=args.loss,
        optimizer=args.optimizer,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "plan": plan.strategy.to_dict(),
                    "stages": [list(stage.layers) for stage in plan.stages],
                    "losses": report.losses,
                    "reference_losses": report.reference_losses,
                    "max_loss_diff": report.max_loss_diff,
                    "max_param_diff": report.max_param_diff,
                    "loss_tolerance": report.loss_tolerance,
                    "param_tolerance": report.param_tolerance,
                    "passed": report.passed,
                },
                indent=2,
            )
        )
    else:
        console.print(plan.text())
        for i, (a, b) in enumerate(zip(report.losses, report.reference_losses, strict=True)):
            console.print(f"step {i}: loss {a:.6f}  reference {b:.6f}  diff {abs(a - b):.2e}")
        console.print(
            f"max parameter diff {report.max_param_diff:.2e} (tolerance {report.param_tolerance:.0e}), "
            f"max loss diff {report.max_loss_diff:.2e} (tolerance {report.loss_tolerance:.0e}): "
            f"{'PASS' if report.passed else 'FAIL'}"
        )
    if not report.passed:
        raise SystemExit(1)
