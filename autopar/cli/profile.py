"""``autopar profile``, ``autopar profile-comm`` and ``autopar calibrate`` (profile, then
compile, then check the predictions on the real cluster)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from autopar.cli.common import positive, progress_bar, read_plan
from autopar.errors import AutoparError
from autopar.files import check_writable
from autopar.units import parse_quantity


def _sizes(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sorted(set(values))


def _bytes(text: str) -> int:
    try:
        return int(parse_quantity(text, "bytes", "--max-bytes"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parsers(sub: Any) -> None:
    """The three subcommands' arguments."""
    p = sub.add_parser("profile", help="measure each layer type's forward/backward time on this device")
    p.add_argument("model", metavar="MODEL", help="zoo name, path/to/file.py:factory or pkg.mod:factory")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda if visible, else cpu"
    )
    p.add_argument("--batch", type=_sizes, default=[1, 2, 4], help="micro-batch sizes, e.g. 1,2,4 (default)")
    p.add_argument("--seq", type=positive, default=None, help="sequence length (default: the model's)")
    p.add_argument(
        "--tp-widths", type=_sizes, default=[1], help="TP widths to profile, e.g. 1,2,4,8 (default 1)"
    )
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also profile widths > 1 with sequence parallelism (default on)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="training dtype")
    p.add_argument(
        "--compile",
        action="store_true",
        help="time each block compiled by torch.compile (prices plans with --compile block)",
    )
    p.add_argument("--warmup", type=positive, default=2, help="untimed iterations (default 2)")
    p.add_argument("--repeat", type=positive, default=5, help="timed iterations, median kept (default 5)")
    p.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="CPU threads (default: torch's; torchrun gives each rank 1, so profile with 1 for gloo runs)",
    )
    p.add_argument("--out", required=True, help="write the profile JSON here")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")

    p = sub.add_parser(
        "profile-comm", help="under torchrun: time collectives on the planner's groups and fit them"
    )
    p.add_argument("--out", required=True, help="write the fits as JSON here (rank 0)")
    p.add_argument("--min-bytes", type=_bytes, default=4, help="smallest message (default 4 B)")
    p.add_argument("--max-bytes", type=_bytes, default=256 * 2**20, help="largest message (default 256 MiB)")
    p.add_argument("--warmup", type=positive, default=2, help="untimed repeats per size (default 2)")
    p.add_argument("--repeat", type=positive, default=10, help="timed repeats per size (default 10)")
    p.add_argument("--json", action="store_true", help="print the fits as JSON")

    p = sub.add_parser(
        "calibrate", help="under torchrun: run plans and compare measured with predicted step time"
    )
    p.add_argument("model", metavar="MODEL", help="zoo name or factory building real weights")
    p.add_argument("--plan", action="append", required=True, help="a plan JSON (repeat for several)")
    p.add_argument("--steps", type=positive, default=8, help="timed steps per plan (default 8)")
    p.add_argument("--warmup", type=positive, default=2, help="untimed steps first (default 2)")
    p.add_argument(
        "--max-error", type=float, default=None, help="exit 1 if any |error| exceeds this fraction"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def cmd_profile(args: argparse.Namespace, console: Console) -> None:
    import warnings

    import torch

    from autopar.measure.profile import profile_compute
    from autopar.measurements import dumps, write
    from autopar.zoo.registry import model_seq

    check_writable(args.out)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    seq = model_seq(args.model, args.seq, dtype=args.dtype)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with progress_bar(rank0 and not args.json) as update, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-op process group's collectives warn per call
        profile = profile_compute(
            args.model,
            batches=args.batch,
            seq=seq,
            tp_widths=args.tp_widths,
            sequence_parallel=args.sequence_parallel,
            dtype=args.dtype,
            warmup=args.warmup,
            repeat=args.repeat,
            device=device,
            progress=update,
            compiled=args.compile,
        )
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun every rank measures at once (shared caches and memory bandwidth)
    write(profile, args.out)
    if args.json:
        print(dumps(profile), end="")
        return
    console.print(
        f"{args.model} on {profile.device} ({profile.threads} threads, torch {profile.torch_version}), "
        f"seq {seq}, {args.dtype}{', blocks compiled' if profile.compiled else ''}, median of "
        f"{args.repeat} after {args.warmup} warm-up"
    )
    table = Table(show_edge=False)
    for col in ("layer type", "micro-batch", "tp", "sp", "forward", "backward", "bwd/fwd", "saved"):
        table.add_column(col, justify="left" if col == "layer type" else "right")
    from autopar.units import format_bytes

    for t in profile.layers:
        table.add_row(
            t.layer_type,
            str(t.micro_batch),
            str(t.tp),
            "yes" if t.sequence_parallel else "",
            f"{1e3 * t.forward_s:.2f} ms",
            f"{1e3 * t.backward_s:.2f} ms",
            f"{t.backward_s / t.forward_s:.2f}",
            format_bytes(t.saved_bytes),
        )
    console.print(table)
    console.print(f"optimizer (AdamW): {1e9 * profile.optimizer_s_per_param:.2f} ns per parameter")
    console.print(f"written to {args.out}")


def cmd_profile_comm(args: argparse.Namespace, console: Console) -> None:
    import torch
    import torch.distributed as dist

    from autopar.measure.comm import measure_comm
    from autopar.measurements import dumps, write
    from autopar.runtime import init_distributed

    if "RANK" not in os.environ:
        raise AutoparError(
            "profile-comm runs under torchrun: "
            "torchrun --nproc-per-node N -m autopar profile-comm --out comm.json"
        )
    check_writable(args.out)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_distributed()
    rank = dist.get_rank()
    with progress_bar(rank == 0 and not args.json) as update:
        profile = measure_comm(
            min_bytes=args.min_bytes,
            max_bytes=args.max_bytes,
            warmup=args.warmup,
            repeat=args.repeat,
            progress=update,
        )
    if rank == 0:
        write(profile, args.out)
        if args.json:
            print(dumps(profile), end="")
        else:
            table = Table(
                show_edge=False,
                title=f"{profile.backend}, {profile.world_size} ranks, {profile.gpus_per_node} per node",
            )
            for col in ("collective", "ranks", "where", "latency", "bandwidth (ring β)", "largest message"):
                table.add_column(col, justify="left" if col in ("collective", "where") else "right")
            for f in profile.fits:
                table.add_row(
                    f.collective,
                    str(f.group_size),
                    "across nodes" if f.crosses_nodes else "in a node",
                    f"{1e6 * f.latency_s:.1f} µs",
                    f"{f.bus_bandwidth_bytes_per_s / 1e9:.2f} GB/s",
                    f"{1e3 * f.times_s[-1]:.2f} ms at {f.sizes_bytes[-1]:,} B",
                )
            console.print(table)
            console.print(f"written to {args.out}")
    dist.destroy_process_group()


def cmd_calibrate(args: argparse.Namespace, console: Console) -> None:
    import torch.distributed as dist

    from autopar.measure.calibrate import time_plans
    from autopar.planner import ModelProfiles
    from autopar.runtime import init_distributed

    if "RANK" not in os.environ:
        raise AutoparError(
            "calibrate runs under torchrun: "
            "torchrun --nproc-per-node N -m autopar calibrate MODEL --plan plan.json"
        )
    plans = [(os.path.splitext(os.path.basename(path))[0], read_plan(path)) for path in args.plan]
    init_distributed()
    st = plans[0][1].strategy
    vocab = ModelProfiles.of(args.model, dtype=st.dtype, seq=st.seq).base.vocab
    results = time_plans(args.model, plans, vocab=vocab, steps=args.steps, warmup=args.warmup)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return
    worst = max(abs(r.error) for r in results)
    if args.json:
        print(json.dumps({"plans": [r.to_dict() for r in results], "max_abs_error": worst}, indent=2))
    else:
        table = Table(show_edge=False, title="predicted vs measured step time (median after warm-up)")
        for col in ("plan", "tp", "pp", "dp", "zero", "mb×m", "predicted", "measured", "error"):
            table.add_column(col, justify="left" if col == "plan" else "right")
        for r in results:
            st = r.plan.strategy
            table.add_row(
                r.label,
                str(st.tp),
                str(st.pp),
                str(st.dp),
                str(st.zero),
                f"{st.micro_batch}×{st.micro_batches}",
                f"{1e3 * r.predicted_s:.1f} ms",
                f"{1e3 * r.measured_s:.1f} ms",
                f"{100 * r.error:+.1f}%",
            )
        console.print(table)
        console.print(f"largest |error| {100 * worst:.1f}%")
    if args.max_error is not None and worst > args.max_error:
        raise SystemExit(1)


__all__ = ["add_parsers", "cmd_calibrate", "cmd_profile", "cmd_profile_comm"]
