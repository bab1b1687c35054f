"""Train a GPT that re-plans itself on what it measures (``autopar.Adaptive``), under torchrun.

    torchrun --nproc-per-node 2 examples/train_adaptive.py [--cluster cpu|PRESET|file.yaml]
        [--steps 60] [--every 5] [--global-batch 4] [--seq 32] [--folder DIR] [--metrics-jsonl FILE]

The cluster is what the run is told about the machine (default: this machine as the ``cpu``
preset describes it; give a YAML to try a wrong description, e.g. links it does not have).
Every ``--every`` steps the run calibrates the cluster on its own step times and links,
re-plans, and moves to the new plan in process when the move pays for itself over the steps
left; each decision is one line on stderr (and an event in ``--metrics-jsonl``, which
``autopar report PLAN --metrics FILE`` shows). A switch moves the state through ``--folder``
(default a temporary folder; across nodes give one every node reads). Step k's batch depends on
k alone
(``autopar.GlobalBatches``), so the samples are the same whichever plan trains them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import autopar
from autopar.adapt import describe
from autopar.zoo import GPT, GPTConfig

CFG = GPTConfig(n_layer=8, n_embd=512, n_head=8, vocab_size=512, block_size=32)


def build() -> torch.nn.Module:
    """The model, seeded: the same weights on every rank (and when a switch builds it again)."""
    torch.manual_seed(0)
    return GPT(CFG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="cpu", help="preset name or YAML the run is told it runs on")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5, help="steps per calibration window")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--folder", default=None, help="where a switch moves the state (shared across nodes)")
    parser.add_argument("--metrics-jsonl", default=None, help="per-step metrics and decisions (rank 0)")
    args = parser.parse_args()
    autopar.init_distributed()
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cluster = autopar.Cluster.load(args.cluster, nodes=world // per_node, gpus_per_node=per_node)
    adaptive = autopar.Adaptive(
        build,
        cluster,
        steps=args.steps,
        global_batch=args.global_batch,
        seq=args.seq,
        config=autopar.AdaptConfig(every=args.every, folder=args.folder),
        metrics={"jsonl": args.metrics_jsonl} if args.metrics_jsonl else None,
    )
    data = torch.randint(0, CFG.vocab_size, (1024, args.seq), generator=torch.Generator().manual_seed(0))
    batches = autopar.GlobalBatches(len(data), args.global_batch, seed=0)
    for step in range(args.steps):
        pm = adaptive.pm  # a switch replaces it: read it every step
        loss = pm.train_step(data[batches.local(step, pm)])
        adaptive.step_done(step, loss)
        if dist.get_rank() == 0 and step % args.every == 0:
            print(f"step {step:3d}  loss {loss:.4f}  {pm.last_step_s:.3f} s", flush=True)
    if dist.get_rank() == 0:
        print(f"switches: {len(adaptive.switches)}; final plan: {describe(adaptive.pm.plan.strategy)}")
    adaptive.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except autopar.AutoparError as e:  # one line per rank; torchrun sees the exit status
        sys.stderr.write(f"rank {os.environ.get('RANK', '0')}: {e}\n")
        sys.exit(1)
