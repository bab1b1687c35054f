"""The ``autopar`` command line: ``plan``, ``estimate``, ``inspect``, ``models``, ``clusters``.

Exit codes: 0 success, 2 user error (one line on stderr, no traceback), 1 bug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

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
    g = p.add_argument_group("constraints (default: free)")
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
        "--recompute",
        default="none,selective,full",
        help="recompute choices allowed, comma-separated (default none,selective,full)",
    )
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
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=None,
        help="memory kept back per GPU (default 1 GiB + 5%% of device memory)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("verify", help="run a plan on local gloo processes against single-process training")
    p.add_argument("model", metavar="MODEL", help="zoo name or factory returning a model with real weights")
    p.add_argument("--cluster", default="cpu", help="cluster preset or YAML (default cpu)")
    p.add_argument("--nproc", type=_positive, default=2, help="local processes (default 2)")
    p.add_argument("--plan", default=None, help="a plan JSON (from autopar plan --out); else planned here")
    p.add_argument("--steps", type=_positive, default=3, help="training steps to compare (default 3)")
    p.add_argument("--global-batch", type=_positive, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=_positive, default=32, help="sequence length (default 32)")
    p.add_argument("--dp", type=_positive, default=None)
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None)
    p.add_argument("--micro-batch", type=_positive, default=None)
    p.add_argument("--recompute", default="none,selective,full", help="recompute choices allowed")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument(
        "--loss",
        default=None,
        help="module:fn or file.py:fn taking (model output, tokens) → scalar (default next-token CE)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

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
    _progress(args, f"capturing {args.model} at batch {args.batch}, seq {seq} …")
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
            _count(t["params"]),
            format_si(t["fwd_flops"], "FLOP"),
            format_si(t["bwd_flops"], "FLOP"),
            format_bytes(t["saved_bytes"]),
        )
    table.add_row(
        "[bold]total[/bold]",
        str(rep["num_layers"]),
        _count(rep["total_params"]),
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
                _count
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

    cluster = Cluster.load(args.cluster, nodes=args.nodes)
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
        dtype=args.dtype,
    )
    if strategy.world_size != cluster.world_size:  # before the capture: say it at once
        check_strategy(strategy, world_size=cluster.world_size, blocks=10**9, heads=None)
    _progress(args, f"capturing {args.model} at micro-batch {args.micro_batch}, seq {seq} …")
    profile = profile_model(args.model, dtype=args.dtype, micro_batch=args.micro_batch, seq=seq)
    reserve = args.reserve_gib * 2**30 if args.reserve_gib is not None else None
    est = estimate(profile, cluster, strategy, reserve_bytes=reserve)
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
        f"{', SP' if st.sequence_parallel else ''}, {st.dtype}"
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


def cmd_plan(args: argparse.Namespace, console: Console) -> None:
    from autopar.cluster import Cluster
    from autopar.cost_models.strategy import RECOMPUTE
    from autopar.costing import profile_fn
    from autopar.models import resolve
    from autopar.planner import Constraints, make_plan

    cluster = Cluster.load(args.cluster, nodes=args.nodes)
    seq = args.seq or resolve(args.model, dtype=args.dtype).default_seq
    allowed = tuple(x.strip() for x in args.recompute.split(",") if x.strip())
    if not allowed or any(x not in RECOMPUTE for x in allowed):
        raise AutoparError(
            f"--recompute takes a comma-separated subset of {', '.join(RECOMPUTE)}, got {args.recompute!r}"
        )
    constraints = Constraints(
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        zero=args.zero,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        sequence_parallel=args.sequence_parallel,
        recompute=allowed,
        memory_cap_bytes=args.memory_cap_gib * 2**30 if args.memory_cap_gib else None,
    )
    _progress(args, f"capturing {args.model} at seq {seq} …")
    profile_at = profile_fn(args.model, dtype=args.dtype, seq=seq)
    profile_at(1)
    profile_at(2)  # the two captures every micro-batch size is derived from
    _progress(args, "planning …")
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
    console.print(plan.text().splitlines()[0])
    console.print(plan.text().splitlines()[1])
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
        counts = {c: sum(1 for _, r in s.recompute if r == c) for c in ("none", "selective", "full")}
        states = mem["weights"] + mem["gradients"] + mem["optimizer"]
        other = mem["loss"] + mem["comm_buffers"] + mem["reserve"]
        table.add_row(
            str(s.index),
            f"{s.layers[0]} … {s.layers[-1]} ({len(s.layers)})",
            ", ".join(f"{n} {c}" for c, n in counts.items() if n) or "-",
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
    from autopar.planner import Constraints, make_plan
    from autopar.verify import verify_plan

    if args.plan:
        try:
            with open(args.plan) as f:
                plan = Plan.from_json(f.read())
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError, AutoparError) as e:
            raise AutoparError(f"can't read plan {args.plan!r}: {e}") from None
    else:
        cluster = Cluster.load(args.cluster, gpus_per_node=args.nproc)
        allowed = tuple(x.strip() for x in args.recompute.split(",") if x.strip())
        constraints = Constraints(
            tp=1, pp=1, dp=args.dp, zero=args.zero, micro_batch=args.micro_batch, recompute=allowed
        )
        plan = make_plan(
            args.model,
            profile_fn(args.model, dtype=args.dtype, seq=args.seq),
            cluster,
            global_batch=args.global_batch,
            seq=args.seq,
            dtype=args.dtype,
            constraints=constraints,
        ).plan
    _progress(args, f"running {plan.strategy.world_size} processes and the single-process reference …")
    vocab = profile_fn(args.model, dtype=args.dtype, seq=plan.strategy.seq)(1).vocab
    if args.loss:
        from autopar.verify import resolve_loss

        resolve_loss(args.loss)  # a bad --loss is a user error here, not in every worker
    report = verify_plan(
        args.model, plan, nproc=args.nproc, steps=args.steps, vocab=vocab, loss_spec=args.loss
    )
    if args.json:
        print(
            json.dumps(
                {
                    "plan": plan.strategy.to_dict(),
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
        table.add_row(r["name"], r["family"], _count(r["params"]), str(r["default_seq"]), r["source"])
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


def _progress(args: argparse.Namespace, message: str) -> None:
    """A progress line on stderr, for people at a terminal (never in --json or piped runs)."""
    if not args.json and sys.stderr.isatty():
        Console(stderr=True).print(f"[dim]{message}[/dim]")


def _count(n: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f}"


COMMANDS: dict[str, Any] = {
    "plan": cmd_plan,
    "inspect": cmd_inspect,
    "estimate": cmd_estimate,
    "verify": cmd_verify,
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
