"""The ``autopar`` command line: ``plan``, ``estimate``, ``inspect``, ``verify``, ``profile``,
``profile-comm``, ``calibrate``, ``models``, ``clusters``.

Exit codes: 0 success, 2 user error (one line on stderr, no traceback), 1 bug.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.cli_common import count, progress
from autopar.cli_plan import cmd_plan, cmd_verify
from autopar.cli_profile import add_parsers, cmd_calibrate, cmd_profile, cmd_profile_comm
from autopar.cost_models.strategy import TP_OBJECTIVES
from autopar.errors import AutoparError
from autopar.units import format_bytes, format_si


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_constraint_flags(g: argparse._ArgumentGroup) -> None:
    """The plan knobs `autopar plan` and `autopar verify` share (None: the planner chooses)."""
    g.add_argument("--tp", type=_positive, default=None, help="fix the tensor-parallel degree")
    g.add_argument("--pp", type=_positive, default=None, help="fix the pipeline-parallel degree")
    g.add_argument("--dp", type=_positive, default=None, help="fix the data-parallel degree")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None, help="fix the ZeRO stage")
    g.add_argument("--micro-batch", type=_positive, default=None, help="fix the micro-batch size")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default=None)
    g.add_argument("--virtual-stages", type=_positive, default=None, help="fix v (interleaved)")
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
        "--recompute",
        default="none,selective,full",  # cli_plan.RECOMPUTE_DEFAULT
        help="recompute choices allowed, comma-separated (default none,selective,full)",
    )


def _add_measured_flags(p: argparse.ArgumentParser) -> None:
    """--profile / --comm: measured numbers in place of the cluster's analytic ones."""
    p.add_argument("--profile", default=None, help="compute profile JSON from `autopar profile`")
    p.add_argument("--comm", default=None, help="collective fits JSON from `autopar profile-comm`")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar", description="Plan and run parallel training for a PyTorch model."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="capture a model and show its layers, FLOPs and memory")
    p.add_argument("model", metavar="MODEL", help="zoo name, path/to/file.py:factory or pkg.mod:factory")
    p.add_argument("--batch", type=_positive, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="parameter and activation dtype (default bf16)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("plan", help="find the fastest predicted plan that fits, and say why")
    p.add_argument("model", metavar="MODEL", help="zoo name, path/to/file.py:factory or pkg.mod:factory")
    p.add_argument("--cluster", required=True, help="preset name (see `autopar clusters`) or YAML file")
    p.add_argument("--nodes", type=_positive, default=None, help="number of nodes (default 1)")
    p.add_argument("--global-batch", type=_positive, required=True, help="sequences per step")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--top", type=_positive, default=5, help="runners-up to show (default 5)")
    p.add_argument("--time-limit", type=float, default=10.0, help="ILP time limit in seconds (default 10)")
    p.add_argument("--out", default=None, help="write the plan as JSON to this file")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_measured_flags(p)
    g = p.add_argument_group("constraints (default: free)")
    _add_constraint_flags(g)
    g.add_argument("--memory-cap-gib", type=float, default=None, help="plan for at most this memory per GPU")

    p = sub.add_parser("estimate", help="predict step time, throughput and memory of one plan")
    p.add_argument("model", metavar="MODEL", help="zoo name, path/to/file.py:factory or pkg.mod:factory")
    p.add_argument("--cluster", required=True, help="preset name (see `autopar clusters`) or YAML file")
    p.add_argument("--nodes", type=_positive, default=None, help="number of nodes (default 1)")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel degree (default 1)")
    p.add_argument("--dp", type=_positive, default=None, help="data-parallel degree (default: the rest)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage (default 0)")
    p.add_argument("--micro-batch", type=_positive, default=1, help="sequences per micro-batch")
    p.add_argument("--global-batch", type=_positive, required=True, help="sequences per step")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    p.add_argument(
        "--virtual-stages",
        type=_positive,
        default=None,
        help="model chunks per pipeline rank (interleaved; default 2)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    p.add_argument(
        "--tp-objective",
        choices=TP_OBJECTIVES,
        default="time",
        help="what the per-operator TP choice minimises (default time)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=None,
        help="memory kept back per GPU (default 1 GiB + 5%% of device memory)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_measured_flags(p)

    p = sub.add_parser("verify", help="run a plan on local gloo processes against single-process training")
    p.add_argument("model", metavar="MODEL", help="zoo name or factory returning a model with real weights")
    p.add_argument("--cluster", default="cpu", help="cluster preset or YAML (default cpu)")
    p.add_argument("--nproc", type=_positive, default=2, help="local processes (default 2)")
    p.add_argument("--plan", default=None, help="a plan JSON (from autopar plan --out); else planned here")
    p.add_argument("--steps", type=_positive, default=3, help="training steps to compare (default 3)")
    p.add_argument("--global-batch", type=_positive, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=_positive, default=32, help="sequence length (default 32)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="fp32")
    _add_constraint_flags(p.add_argument_group("plan options when no --plan is given (default: planned)"))
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
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    add_parsers(sub, _positive)

    p = sub.add_parser("models", help="list the built-in models")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("clusters", help="list the built-in cluster presets")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def cmd_inspect(args: argparse.Namespace, console: Console) -> None:
    from autopar.graph import capture
    from autopar.inspection import report
    from autopar.models import resolve

    resolved = resolve(args.model, dtype=args.dtype)
    seq = args.seq or resolved.default_seq
    progress(args, f"capturing {args.model} at batch {args.batch}, seq {seq} …")
    cap = capture(resolved.module, batch=args.batch, seq=seq)
    rep = report(cap, model=args.model, dtype=args.dtype, gpt=resolved.gpt)
    if args.json:
        print(json.dumps(rep, indent=2))
        return
    spliced = (
        f"{rep['traced_blocks']} blocks traced, the rest spliced"
        if cap.traced_blocks and cap.traced_blocks < len(cap.layers) - 2
        else "fully traced"
    )
    console.print(
        f"[bold]{args.model}[/bold]  batch {cap.batch}  seq {cap.seq}  {args.dtype}  "
        f"captured in {cap.capture_s:.1f} s ({rep['nodes']} nodes, {spliced})"
    )
    table = Table(show_edge=False)
    for col in ("layer type", "count", "params", "fwd FLOPs", "bwd FLOPs", "saved for bwd"):
        table.add_column(col, justify="left" if col == "layer type" else "right")
    for t in rep["layer_types"]:
        table.add_row(
            t["name"],
            str(t["count"]),
            count(t["params"]),
            format_si(t["fwd_flops"], "FLOP"),
            format_si(t["bwd_flops"], "FLOP"),
            format_bytes(t["saved_bytes"]),
        )
    table.add_row(
        "[bold]total[/bold]",
        str(rep["num_layers"]),
        count(rep["total_params"]),
        format_si(rep["forward_flops"], "FLOP"),
        format_si(rep["total_flops"] - rep["forward_flops"], "FLOP"),
        format_bytes(rep["saved_bytes"]),
    )
    console.print(table)
    console.print(f"one training step (fwd + bwd, model FLOPs): {format_si(rep['total_flops'], 'FLOP')}")
    if rep["checks"]:
        checks = Table(title="closed-form cross-checks", show_edge=False, title_justify="left")
        for col in ("quantity", "formula", "closed form", "captured", "diff"):
            checks.add_column(col, justify="left" if col in ("quantity", "formula") else "right")
        for c in rep["checks"]:
            fmt = (
                count
                if c["name"] == "parameters"
                else ((lambda x: format_si(x, "FLOP")) if "FLOP" in c["name"] else format_bytes)
            )
            checks.add_row(
                c["name"],
                c["formula"],
                fmt(c["expected"]),
                fmt(c["captured"]),
                f"{100 * c['rel_error']:+.2f}%",
            )
        console.print(checks)
        for c in rep["checks"]:
            if c["note"]:
                console.print(f"[dim]  {c['name']}: {c['note']}[/dim]")


def cmd_estimate(args: argparse.Namespace, console: Console) -> None:
    from autopar.cluster import Cluster
    from autopar.cost_models.estimate import estimate
    from autopar.cost_models.strategy import Strategy, StrategyError, check_strategy
    from autopar.costing import profile_model
    from autopar.models import resolve
    from autopar.tp_layouts import TPLayouts

    cluster = Cluster.load(args.cluster, nodes=args.nodes).from_profile(compute=args.profile, comm=args.comm)
    seq = args.seq or resolve(args.model, dtype=args.dtype).default_seq
    dp = args.dp
    if dp is None:
        dp, rem = divmod(cluster.world_size, args.tp * args.pp)
        if rem or dp == 0:
            raise StrategyError(
                f"tp·pp = {args.tp * args.pp} does not divide the cluster's {cluster.world_size} GPUs"
            )
    virtual = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    strategy = Strategy(
        tp=args.tp,
        pp=args.pp,
        dp=dp,
        zero=args.zero,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        seq=seq,
        recompute=args.recompute,
        schedule=args.schedule,
        virtual_stages=virtual,
        sequence_parallel=args.sequence_parallel,
        tp_objective=args.tp_objective,
        dtype=args.dtype,
    )
    if strategy.world_size != cluster.world_size:  # before the capture: say it at once
        check_strategy(strategy, world_size=cluster.world_size, blocks=10**9, heads=None)
    progress(args, f"capturing {args.model} at micro-batch {args.micro_batch}, seq {seq} …")
    profile = profile_model(args.model, dtype=args.dtype, micro_batch=args.micro_batch, seq=seq)
    reserve = args.reserve_gib * 2**30 if args.reserve_gib is not None else None
    layouts = TPLayouts(lambda _: profile, cluster, args.dtype)  # the per-operator TP choice
    est = estimate(profile, cluster, strategy, reserve_bytes=reserve, tp_layout=layouts(strategy))
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "cluster": cluster.name,
                    "nodes": cluster.num_nodes,
                    **est.to_dict(),
                },
                indent=2,
            )
        )
        return
    st = strategy
    console.print(
        f"[bold]{args.model}[/bold] on {cluster.num_nodes}× {cluster.name} ({cluster.world_size} GPUs): "
        f"tp {st.tp} · pp {st.pp} · dp {st.dp}, ZeRO-{st.zero}, micro-batch {st.micro_batch} × "
        f"{st.micro_batches}, global batch {st.global_batch}, seq {st.seq}, {st.schedule}"
        f"{f' v={st.virtual_stages}' if st.virtual_stages > 1 else ''}, recompute {st.recompute}"
        f"{', SP' if st.sequence_parallel else ''}"
        f"{', leanest TP layout' if st.tp > 1 and st.tp_objective == 'memory' else ''}, {st.dtype}"
    )
    table = Table(title="step time", show_edge=False, title_justify="left")
    table.add_column("term")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for term, value in est.breakdown_s.items():
        table.add_row(term.replace("_", " "), f"{value:.4f}", f"{100 * value / est.step_time_s:.1f}%")
    table.add_row("[bold]step[/bold]", f"[bold]{est.step_time_s:.4f}[/bold]", "100%")
    console.print(table)
    console.print(
        f"{est.tokens_per_s:,.0f} tokens/s · {est.tflops_per_gpu:.1f} TFLOP/s per GPU model "
        f"(MFU {100 * est.mfu:.1f}%) · {est.hardware_tflops_per_gpu:.1f} hardware (HFU {100 * est.hfu:.1f}%)"
    )
    mem = Table(title="memory per GPU by pipeline stage", show_edge=False, title_justify="left")
    cols = ("weights", "gradients", "optimizer", "activations", "loss", "comm_buffers", "reserve")
    mem.add_column("stage")
    for col in (*cols, "peak"):
        mem.add_column(col.replace("_", " "), justify="right")
    stages = list(est.memory)
    shown = stages if len(stages) <= 8 else [*stages[:4], *stages[-4:]]
    for m in shown:
        row = m.to_dict()
        mem.add_row(str(m.stage), *(format_bytes(row[c]) for c in cols), format_bytes(m.peak_bytes))
    console.print(mem)
    worst = max(est.memory, key=lambda m: m.peak_bytes)
    capacity = format_bytes(est.memory_capacity_bytes)
    if est.fits:
        console.print(f"fits: yes (largest stage {format_bytes(worst.peak_bytes)} of {capacity})")
    else:
        console.print(
            f"[bold red]does not fit[/bold red]: stage {worst.stage} needs "
            f"{format_bytes(worst.peak_bytes)} of {capacity}; try a higher --zero, --recompute full, "
            "a smaller --micro-batch or more --tp/--pp"
        )
    for note in est.notes:
        console.print(f"[dim]note: {note}[/dim]")


def cmd_models(args: argparse.Namespace, console: Console) -> None:
    from autopar.zoo import ZOO, build

    rows: list[dict[str, Any]] = []
    for name, entry in ZOO.items():
        params = sum(p.numel() for p in build(name).parameters())
        rows.append(
            {
                "name": name,
                "family": entry.family,
                "params": params,
                "default_seq": entry.default_seq,
                "source": entry.source,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(show_edge=False)
    for col in ("model", "family", "params", "seq", "shape from"):
        table.add_column(col, justify="right" if col in ("params", "seq") else "left")
    for r in rows:
        table.add_row(r["name"], r["family"], count(r["params"]), str(r["default_seq"]), r["source"])
    console.print(table)


def cmd_clusters(args: argparse.Namespace, console: Console) -> None:
    from autopar.cluster import Cluster, preset_names

    clusters = [Cluster.preset(name) for name in preset_names()]
    if args.json:
        print(json.dumps([c.to_dict() for c in clusters], indent=2))
        return
    table = Table(show_edge=False)
    for col in (
        "preset",
        "device",
        "per node",
        "memory",
        "bf16 peak",
        "HBM",
        "intra-node",
        "inter-node/node",
    ):
        table.add_column(col, justify="left" if col in ("preset", "device") else "right")
    for c in clusters:
        d = c.device
        table.add_row(
            c.name,
            d.name,
            str(c.gpus_per_node),
            format_bytes(d.memory_bytes),
            format_si(d.peak_flops["bf16"], "FLOP/s"),
            format_si(d.hbm_bandwidth_bytes_per_s, "B/s"),
            format_si(c.intra_node.bandwidth_bytes_per_s, "B/s"),
            format_si(c.inter_node.bandwidth_bytes_per_s, "B/s"),
        )
    console.print(table)
    console.print("[dim]use with --nodes N; or write a YAML file (see README)[/dim]")


COMMANDS: dict[str, Any] = {
    "plan": cmd_plan,
    "inspect": cmd_inspect,
    "estimate": cmd_estimate,
    "verify": cmd_verify,
    "profile": cmd_profile,
    "profile-comm": cmd_profile_comm,
    "calibrate": cmd_calibrate,
    "models": cmd_models,
    "clusters": cmd_clusters,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Wide enough for the tables when piped; a terminal sets its own width.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    try:
        COMMANDS[args.command](args, console)
    except AutoparError as e:
        print(f"autopar {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
