"""``autopar inspect`` (a capture's layers, FLOPs and memory) and ``autopar estimate`` (one
strategy's predicted step time, throughput and memory)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.cli.common import (
    CLUSTER_HELP,
    DTYPES,
    MODEL_HELP,
    add_json_flag,
    add_knob_flags,
    add_measured_flags,
    count,
    knob_values,
    non_negative_float,
    positive,
    print_json,
    progress,
)
from autopar.recompute_policy import RECOMPUTE, SAC, is_recompute_name
from autopar.units import format_bytes, format_si


def recompute_choice(text: str) -> str:
    """argparse type: one recompute choice (``sac`` alone names no single policy)."""
    if text == SAC or not is_recompute_name(text):
        raise argparse.ArgumentTypeError(
            f"expected none, selective, full or a per-operator policy (sac1, sac2, …), got {text!r}"
        )
    return text


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("inspect", help="capture a model and show its layers, FLOPs and memory")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--batch", type=positive, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=positive, default=None, help="sequence length (default: the model's)")
    p.add_argument(
        "--dtype", choices=DTYPES, default="bf16", help="parameter and activation dtype (default bf16)"
    )
    add_json_flag(p)

    p = sub.add_parser("estimate", help="predict step time, throughput and memory of one plan")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    p.add_argument("--nodes", type=positive, default=None, help="number of nodes (default 1)")
    add_knob_flags(p, fixing=False)
    p.add_argument("--global-batch", type=positive, required=True, help="sequences per step")
    p.add_argument("--seq", type=positive, default=None, help="sequence length (default: the model's)")
    p.add_argument(
        "--recompute",
        type=recompute_choice,
        default="none",
        help="recompute of every block: none (default), selective, full, or a per-operator policy "
        "sac1, sac2, … (`autopar plan` lists them; sac1 keeps the fewest bytes)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument(
        "--reserve-gib",
        type=non_negative_float,
        default=None,
        help="memory kept back per GPU (default 1 GiB + 5%% of device memory)",
    )
    add_json_flag(p)
    add_measured_flags(p)


def cmd_inspect(args: argparse.Namespace, console: Console) -> None:
    from autopar.graph import capture
    from autopar.measure.inspection import report
    from autopar.zoo.registry import model_seq
    from autopar.zoo.spec import resolve

    resolved = resolve(args.model, dtype=args.dtype)
    seq = model_seq(args.model, args.seq, dtype=args.dtype)
    progress(args, f"capturing {args.model} at batch {args.batch}, seq {seq} …")
    cap = capture(resolved.module, batch=args.batch, seq=seq)
    rep = report(cap, model=args.model, dtype=args.dtype, gpt=resolved.gpt)
    if args.json:
        print_json(rep)
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
        flops = (format_si(t["fwd_flops"], "FLOP"), format_si(t["bwd_flops"], "FLOP"))
        table.add_row(t["name"], str(t["count"]), count(t["params"]), *flops, format_bytes(t["saved_bytes"]))
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
    _print_checks(console, rep["checks"])


def _print_checks(console: Console, checks: list[dict[str, Any]]) -> None:
    """The captured numbers against the closed forms (zoo GPTs)."""
    if not checks:
        return
    table = Table(title="closed-form cross-checks", show_edge=False, title_justify="left")
    for col in ("quantity", "formula", "closed form", "captured", "diff"):
        table.add_column(col, justify="left" if col in ("quantity", "formula") else "right")
    for c in checks:
        if c["name"] == "parameters":
            fmt: Any = count
        else:
            fmt = (lambda x: format_si(x, "FLOP")) if "FLOP" in c["name"] else format_bytes
        table.add_row(
            c["name"], c["formula"], fmt(c["expected"]), fmt(c["captured"]), f"{100 * c['rel_error']:+.2f}%"
        )
    console.print(table)
    for c in checks:
        if c["note"]:
            console.print(f"[dim]  {c['name']}: {c['note']}[/dim]")


def cmd_estimate(args: argparse.Namespace, console: Console) -> None:
    from autopar.groups import load_one_type
    from autopar.planner import ModelProfiles, Pricer
    from autopar.planner.recompute_ilp import recompute_choices
    from autopar.strategy import Strategy, check_strategy
    from autopar.zoo.registry import model_seq

    cluster = load_one_type(args.cluster, what="autopar estimate", nodes=args.nodes).from_profile(
        compute=args.profile, comm=args.comm
    )
    seq = model_seq(args.model, args.seq, dtype=args.dtype)
    knob = knob_values(args)
    strategy = Strategy.for_world(
        cluster.world_size,
        **knob,
        global_batch=args.global_batch,
        seq=seq,
        recompute=args.recompute if args.recompute in RECOMPUTE else "none",
        dtype=args.dtype,
    )
    if strategy.world_size != cluster.world_size:  # before the capture: say it at once
        check_strategy(strategy, world_size=cluster.world_size, blocks=10**9, heads=None)
    progress(args, f"capturing {args.model} at micro-batch {args.micro_batch}, seq {seq} …")
    profiles = ModelProfiles.of(args.model, dtype=args.dtype, seq=seq)
    reserve = args.reserve_gib * 2**30 if args.reserve_gib is not None else None
    # the per-operator TP choice solved on this micro-batch's graph (the search solves once, on
    # micro-batch 1's: the two can differ, see the cost-model issue)
    pricer = Pricer(
        profiles, cluster, dtype=args.dtype, reserve_bytes=reserve, tp_graph_micro_batch=args.micro_batch
    )
    if args.recompute not in RECOMPUTE:  # a per-operator policy: the model's, found here
        recompute_choices((args.recompute,), pricer.policies)  # a name it lacks: one line
        strategy = replace(strategy, policies=pricer.policies, recompute=args.recompute)
    est = pricer.estimate(strategy)
    if args.json:
        print_json(
            {"model": args.model, "cluster": cluster.name, "nodes": cluster.num_nodes, **est.to_dict()}
        )
        return
    _print_estimate(console, args.model, cluster, strategy, est)


def _print_estimate(console: Console, model: str, cluster: Any, st: Any, est: Any) -> None:
    console.print(
        f"[bold]{model}[/bold] on {cluster.num_nodes}× {cluster.name} ({cluster.world_size} GPUs): "
        f"tp {st.tp} · pp {st.pp} · dp {st.dp}{f' · cp {st.cp}' if st.cp > 1 else ''}, ZeRO-{st.zero}, "
        f"micro-batch {st.micro_batch} × "
        f"{st.micro_batches}, global batch {st.global_batch}, seq {st.seq}, {st.schedule}"
        f"{f' v={st.virtual_stages}' if st.virtual_stages > 1 else ''}, recompute {st.recompute}"
        f"{', SP' if st.sequence_parallel else ''}"
        f"{', leanest TP layout' if st.tp > 1 and st.tp_objective == 'memory' else ''}, {st.dtype}"
        f"{f', gradients reduced in {st.grad_reduce}' if st.dp > 1 and st.grad_reduce != 'fp32' else ''}"
        f"{f', HSDP {st.dp_replicate} × {st.dp_shard}' if st.dp_replicate > 1 else ''}"
        f"{f', experts split over ep {st.ep}' if st.ep > 1 else ''}"
        f"{f', PowerSGD rank {st.powersgd_rank}' if st.powersgd_rank else ''}"
        f"{f', DDP buckets of {st.bucket_mb:g} MiB' if st.uses_ddp else ''}"
        f"{', blocks compiled' if st.compile == 'block' else ''}"
    )
    table = Table(title="step time", show_edge=False, title_justify="left")
    table.add_column("term")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for term, value in est.breakdown_s.items():
        table.add_row(term.replace("_", " "), f"{value:.4f}", f"{100 * value / est.step_time_s:.1f}%")
    table.add_row("[bold]step[/bold]", f"[bold]{est.step_time_s:.4f}[/bold]", "100%")
    console.print(table)
    if est.band is not None:
        console.print(f"error band: step {est.step_time_s:.4g} s {est.band.text()}")
    policy = st.policy(st.recompute)
    if policy is not None:
        cost, none = est.recompute_choices[st.recompute], est.recompute_choices["none"]
        console.print(
            f"recompute {policy.name}: {policy.summary}; per block {format_bytes(cost['act_bytes'])} "
            f"kept (none {format_bytes(none['act_bytes'])}), {1e3 * cost['recompute_s']:.2f} ms redone"
        )
    console.print(
        f"{est.tokens_per_s:,.0f} tokens/s · {est.tflops_per_gpu:.1f} TFLOP/s per GPU model "
        f"(MFU {100 * est.mfu:.1f}%) · {est.hardware_tflops_per_gpu:.1f} hardware (HFU {100 * est.hfu:.1f}%)"
    )
    console.print(f"[dim]compute priced at {est.compute_basis}[/dim]")
    _print_memory(console, est)
    for note in est.notes:
        console.print(f"[dim]note: {note}[/dim]")


def _print_memory(console: Console, est: Any) -> None:
    """Memory per GPU by pipeline stage (the first and last four of a long pipeline), and whether it fits."""
    mem = Table(title="memory per GPU by pipeline stage", show_edge=False, title_justify="left")
    cols = ("weights", "gradients", "optimizer", "activations", "loss", "comm_buffers", "reserve")
    mem.add_column("stage")
    for col in (*cols, "peak"):
        mem.add_column(col.replace("_", " "), justify="right")
    stages = list(est.memory)
    for m in stages if len(stages) <= 8 else [*stages[:4], *stages[-4:]]:
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


__all__ = ["add_parsers", "cmd_estimate", "cmd_inspect"]
