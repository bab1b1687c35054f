"""Starting a local process group: ``torch.multiprocessing.spawn`` against ``autopar.measure.launch``
(children forked from a server that imported torch and autopar's runtime once).

    python benchmarks/launch_speed.py [--worlds 2,4,8,2]

Each launch starts ``world`` ranks that import the runtime, join a gloo group, all-reduce one
number and leave: the cost a test or ``autopar verify`` pays before any work. The first
``launch`` also starts its server (the imports, once); later launches fork from it. Prints the
wall seconds of each launch and the ratio spawn / launch over the launches after the first.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time

import torch.multiprocessing as mp

from autopar.measure.launch import launch


def rank_body(rank: int, world: int, init: str) -> None:
    """What every rank pays before work: imports, the group, one collective."""
    import torch
    import torch.distributed as dist

    import autopar.measure.verify  # noqa: F401  (the runtime and the checks a verify rank imports)

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    one = torch.ones(1)
    dist.all_reduce(one)
    dist.destroy_process_group()


def timed(start, world: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        start(rank_body, args=(world, f"file://{tmp}/init"), nprocs=world)
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8,2", help="world sizes launched in turn")
    worlds = [int(w) for w in parser.parse_args().worlds.split(",")]
    rows = []
    for world in worlds:
        rows.append((world, timed(mp.spawn, world), timed(launch, world)))
        print(f"world {world}: spawn {rows[-1][1]:.2f} s, launch {rows[-1][2]:.2f} s", flush=True)
    later = rows[1:] or rows
    ratio = statistics.median(s / f for _, s, f in later)
    print(f"median spawn / launch after the first launch: {ratio:.0f}x")


if __name__ == "__main__":
    main()
