"""Checkpoint save and load times for the benchmark GPT (world 2, gloo, CPU, DP2 ZeRO-1).

    python benchmarks/checkpoint_io.py [--layers 8] [--width 512] [--repeats 3] [--dir DIR]

Per repeat, on both ranks: a synchronous save (``Checkpointer``: training blocked for all of
it), an asynchronous one (blocked only while DCP copies the state to CPU memory; the write and
the commit finish later), a load (files checked against their CRC-32s, then DCP's read), and
the CRC-32 pass alone. Prints the medians (the slower rank's), the checkpoint's size and the
ratio async-blocked / sync, measured in one run. Use ``--dir`` on the file system you train on
(the default is a temporary folder).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from timing import dp2_plan, join, report, run_two  # benchmarks/timing.py

from autopar.runtime import parallelize
from autopar.runtime.checkpointer import Checkpointer
from autopar.runtime.integrity import folder_digest
from autopar.zoo import GPT, GPTConfig

BATCH, SEQ = 4, 64


def config(layers: int, width: int) -> GPTConfig:
    return GPTConfig(n_layer=layers, n_embd=width, n_head=8, vocab_size=8192, block_size=SEQ)


def worker(rank: int, init: str, cfg: GPTConfig, plan: str, repeats: int, folder: str, out: str) -> None:
    join(rank, init)
    from autopar.plan import Plan

    torch.manual_seed(0)
    pm = parallelize(GPT(cfg), Plan.from_json(plan))
    batch = torch.randint(0, cfg.vocab_size, (BATCH // 2, SEQ), generator=torch.Generator().manual_seed(rank))
    t0 = time.perf_counter()
    pm.train_step(batch)  # the optimizer state exists: a checkpoint of a training run
    step_s = time.perf_counter() - t0
    sync, later = (
        Checkpointer(f"{folder}/sync", every=1),
        Checkpointer(f"{folder}/async", every=1, async_save=True),
    )
    times: dict[str, list[float]] = {k: [] for k in ("sync", "async blocked", "async total", "load", "crc")}
    for i in range(repeats):
        dist.barrier()
        path = sync.save(pm, i)
        times["sync"].append(sync.blocked_s)
        dist.barrier()
        t0 = time.perf_counter()
        later.save(pm, i)
        times["async blocked"].append(later.blocked_s)
        later.wait()
        times["async total"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        pm.load(str(path))
        times["load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        folder_digest(path)
        times["crc"].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in times.items()}
    slowest: list[dict[str, float]] = [{}, {}]
    dist.all_gather_object(slowest, medians)
    size = sum(p.stat().st_size for p in Path(path).iterdir())
    result = {k: max(m[k] for m in slowest) for k in medians} | {"bytes": float(size), "step": step_s}
    sync.close()
    later.close()
    report(rank, result, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="where to write the checkpoints (default: a temporary folder)"
    )
    args = parser.parse_args()
    cfg = config(args.layers, args.width)
    with torch.device("meta"):
        meta = GPT(cfg)
    plan = dp2_plan(meta, batch=BATCH, seq=SEQ, zero=1)
    params = sum(p.numel() for p in meta.parameters())
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        t = run_two(worker, cfg, plan, args.repeats, folder)
    gib = t["bytes"] / 2**30
    print(
        f"GPT {args.layers}×{args.width}: {params / 1e6:.1f} M parameters, AdamW, DP2 ZeRO-1 (2 gloo ranks)"
    )
    print(f"checkpoint: {gib:.2f} GiB (model + optimizer state); one training step {t['step']:.2f} s")
    print(f"sync save      {t['sync']:.2f} s blocked ({gib / t['sync']:.2f} GiB/s)")
    print(f"async save     {t['async blocked']:.2f} s blocked, {t['async total']:.2f} s until committed")
    print(f"load           {t['load']:.2f} s (CRC-32 check included)")
    print(f"CRC-32 alone   {t['crc']:.2f} s ({gib / t['crc']:.2f} GiB/s over both ranks)")
    print(f"async blocked / sync = {t['async blocked'] / t['sync']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
