"""``autopar plan``: the fastest predicted plan that fits, and why (runners-up, hand baselines)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.cli.common import (
    CLUSTER_HELP,
    DTYPES,
    MODEL_HELP,
    add_constraint_flags,
    add_json_flag,
    add_measured_flags,
    constraints_from_args,
    positive,
    positive_float,
    print_json,
    progress_bar,
    spinner,
)
from autopar.cli.dryrun import check_top
from autopar.cost_models.bands import band_text
from autopar.errors import AutoparError
from autopar.files import check_writable, write_atomic
from autopar.plan import Plan
from autopar.units import format_bytes


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="find the fastest predicted plan that fits, and say why")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    p.add_argument("--nodes", type=positive, default=None, help="number of nodes (default 1)")
    p.add_argument("--global-batch", type=positive, required=True, help="sequences per step")
    p.add_argument("--seq", type=positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--top", type=positive, default=5, help="runners-up to show (default 5)")
    p.add_argument(
        "--time-limit", type=positive_float, default=10.0, help="ILP time limit in seconds (default 10)"
    )
    p.add_argument("--out", default=None, help="write the plan as JSON to this file")
    p.add_argument(
        "--check",
        nargs="?",
        type=positive,
        const=1,
        default=None,
        metavar="K",
        help="dry-run the plan's distinct ranks (autopar dryrun); with K, up to K plans (the chosen, then "
        "its runners-up) until one builds and fits, which becomes the plan; fail if none does",
    )
    add_json_flag(p, "tables")
    add_measured_flags(p)
    g = p.add_argument_group("constraints (default: free)")
    add_constraint_flags(g)
    g.add_argument(
        "--memory-cap-gib", type=positive_float, default=None, help="plan for at most this memory per GPU"
    )


def cmd_plan(args: argparse.Namespace, console: Console) -> None:
    from autopar.groups import MixedCluster, load_cluster
    from autopar.planner import ModelProfiles, make_plan
    from autopar.request import PlanRequest
    from autopar.zoo.registry import model_seq

    if args.out:
        check_writable(args.out)  # before the work, not after it
    cluster = load_cluster(args.cluster, nodes=args.nodes)
    if isinstance(cluster, MixedCluster):
        if args.profile or args.comm or args.check:
            raise AutoparError(
                f"{args.cluster} has node groups: --profile, --comm and --check work on one type of node "
                "for now; drop them"
            )
    else:
        cluster = cluster.from_profile(compute=args.profile, comm=args.comm)
    request = PlanRequest(
        model=args.model,
        cluster=cluster,
        global_batch=args.global_batch,
        seq=model_seq(args.model, args.seq, dtype=args.dtype),
        dtype=args.dtype,
        constraints=constraints_from_args(
            args, memory_cap_bytes=args.memory_cap_gib * 2**30 if args.memory_cap_gib else None
        ),
        top_k=max(args.top, (args.check or 1) - 1),
        proven_runners_up=(args.check or 1) - 1,  # --check K tries the K fastest, each proven
        time_limit_s=args.time_limit,
    )
    with spinner(args, f"capturing {args.model} at seq {request.seq} …"):
        profiles = ModelProfiles.of(args.model, dtype=args.dtype, seq=request.seq)
        profiles.at(1), profiles.at(2)  # the two captures every micro-batch size is derived from
    with progress_bar(not args.json) as bar:
        result = make_plan(request, profiles, progress=bar)
    plan, checked = check_top(args, request, profiles, result) if args.check else (result.plan, None)
    if args.out:  # the plan that passed its dry run, if asked for one; nothing when none did
        write_atomic(args.out, plan.to_json())
    alternatives, baselines = result.plan.why["alternatives"], result.plan.why["baselines"]
    if args.json:
        print_json(
            {
                "model": args.model,
                "cluster": cluster.name,
                "nodes": cluster.num_nodes,
                "plan": plan.to_dict(),
                "hash": plan.hash,
                "predicted": plan.predicted,
                "alternatives": alternatives,
                "baselines": baselines,
                "solve_time_s": result.solve_time_s,
                "optimality_gap": plan.optimality_gap,
                "ilps_solved": result.ilps_solved,
                "outer_candidates": result.outer_candidates,
                **({"check": checked} if checked is not None else {}),
            }
        )
    else:
        _print_result(console, args, result, plan, checked)


def _print_result(console: Console, args: argparse.Namespace, result: Any, plan: Plan, checked: Any) -> None:
    """The plan (the chosen one, or the runner-up that passed ``--check``) as text: its lines and
    stages, how the search went, what the chosen plan beat, --check's runs."""
    _print_plan(console, plan)
    console.print(
        f"solved in {result.solve_time_s:.2f} s: {result.ilps_solved} layout ILPs over "
        f"{result.outer_candidates} outer choices; proven gap {100 * plan.optimality_gap:.2f}%"
    )
    _print_why(console, plan.why["alternatives"], plan.why["baselines"])
    if args.out:
        console.print(f"[dim]plan written to {args.out}[/dim]")
    for tried in checked or []:
        which = "the chosen plan" if tried["runner_up"] == 0 else f"runner-up {tried['runner_up']}"
        for c in tried["ranks"]:
            fits = "fits" if c["fits"] else "DOES NOT FIT" if not c["failure"] else "FAILED"
            console.print(
                f"dry run of {which}, rank {c['rank']} ({c['role']}): {format_bytes(c['needs_bytes'])} "
                f"with the reserve, predicted {format_bytes(c['predicted'].get('peak_bytes', 0.0))}: {fits}"
            )
    if checked and checked[-1]["runner_up"] > 0:
        console.print(
            f"[bold]the chosen plan failed its dry run ({checked[0]['verdict']}); runner-up "
            f"{checked[-1]['runner_up']} passed and is the plan{' written' if args.out else ''}[/bold]"
        )


def _print_plan(console: Console, plan: Plan) -> None:
    """The plan's text lines, its stages with time and memory, and the predicted throughput."""
    pred = plan.predicted
    lines = plan.text().splitlines()
    console.print(lines[0])
    console.print(lines[1])
    for line in lines:  # per-operator TP strategies and recompute policies of the block type
        if line.startswith(("group ", "tensor parallel ", "recompute ")):
            console.print(line)
    table = Table(title="stages", show_edge=False, title_justify="left")
    comm = "of which TP/CP comm" if plan.strategy.cp > 1 else "of which TP comm"  # cp's K/V gathers too
    cols = ("stage", "layers", "recompute", "time/micro-batch", comm)
    for col in (*cols, "states", "activations", "other", "peak"):
        table.add_column(col, justify="left" if col in ("layers", "recompute") else "right")
    capacities = pred.get("stage_capacity_bytes") or [pred["memory_capacity_bytes"]] * len(plan.stages)
    for s, mem, cap in zip(plan.stages, pred["memory"], capacities, strict=True):
        states = mem["weights"] + mem["gradients"] + mem["optimizer"]
        other = mem["loss"] + mem["comm_buffers"] + mem["reserve"]
        table.add_row(
            str(s.index),
            s.layers_summary,
            s.recompute_summary,
            f"{1e3 * s.time_per_micro_batch_s:.1f} ms",
            f"{1e3 * s.comm_per_micro_batch_s:.1f} ms",
            format_bytes(states),
            format_bytes(mem["activations"]),
            format_bytes(other),
            f"{format_bytes(mem['peak_bytes'])} / {format_bytes(cap)}",
        )
    console.print(table)
    console.print(
        f"predicted: {pred['step_time_s']:.3f} s/step · {pred['tokens_per_s']:,.0f} tokens/s · "
        f"{pred['tflops_per_gpu']:.1f} TFLOP/s per GPU (MFU {100 * pred['mfu']:.1f}%, "
        f"HFU {100 * pred['hfu']:.1f}%); pipeline bubble "
        f"{100 * pred['breakdown_s']['bubble'] / pred['step_time_s']:.1f}% of the step"
    )
    if pred.get("band"):
        console.print(f"error band: step {pred['step_time_s']:.3f} s {band_text(pred['band'])}")
    for note in pred.get("notes", []):
        console.print(f"[dim]note: {note}[/dim]")


def _print_why(console: Console, alternatives: list[dict[str, Any]], baselines: dict[str, Any]) -> None:
    """Runners-up and hand baselines against the chosen plan (``Candidate.to_dict`` rows)."""
    why = Table(
        title="why this plan: runners-up and baselines (same cost model)",
        show_edge=False,
        title_justify="left",
    )
    for col in ("", "tp", "pp", "dp", "ep", "zero", "micro-batch", "schedule", "step s", "vs chosen"):
        why.add_column(col, justify="left" if col in ("", "schedule") else "right")

    def row(label: str, c: dict[str, Any] | None) -> None:
        if c is None:
            why.add_row(label, *["-"] * 7, "does not fit", "")
            return
        st = c["strategy"]
        sched = st["schedule"] + (f" v={st['virtual_stages']}" if st["virtual_stages"] > 1 else "")
        degrees = (str(st.get(k, 1)) for k in ("tp", "pp", "dp", "ep", "zero", "micro_batch"))
        versus = "tied (within the band)" if c.get("tied") else f"{c['slower_by']:.2f}× slower"
        why.add_row(label, *degrees, sched, f"{c['step_time_s']:.3f}", versus)

    for i, c in enumerate(alternatives, 1):
        row(f"runner-up {i}", c)
    for name, c in baselines.items():
        row(name, c)
    console.print(why)


__all__ = ["add_parser", "cmd_plan"]
