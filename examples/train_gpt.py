"""Train a small GPT with autopar on whatever torchrun launched (CPU + gloo here, GPUs + NCCL there).

    torchrun --nproc-per-node 2 examples/train_gpt.py [--steps 20] [--global-batch 16] [--seq 64]
        [--tp T] [--pp P] [--checkpoint DIR --checkpoint-every N [--keep K] [--async-save]
        [--restart-from-scratch]] [--timeout-s T]
        [--metrics-jsonl FILE] [--tensorboard DIR] [--prometheus-port PORT] [--collectives-every N]
        [--max-grad-norm X] [--plan-out FILE] [--save-final FILE]

autopar plans for the launched world (rank 0 plans, every rank gets the same plan; --tp/--pp
fix those degrees, the planner chooses the rest), applies the plan, and this script trains on
a synthetic dataset (a fixed table of token sequences), logging loss, tokens/s, MFU,
measured/predicted step time and peak memory per step on rank 0 (``autopar.Metrics``: also to
JSONL, TensorBoard or Prometheus with the flags; ``autopar report PLAN --metrics FILE --out
report.html`` draws the run against the plan written by --plan-out). With --checkpoint it saves every N steps
(``autopar.Checkpointer``; --async-save writes while training goes on) and, started again,
resumes from the newest complete checkpoint — under the plan for the world it was restarted on,
which may differ. Step k's global batch is a function of k alone (``autopar.GlobalBatches``),
so a resumed run, on any number of processes, sees the same data as one that never stopped.
Restarts: ``torchrun --max-restarts`` (README, "Fault tolerance and elastic training"). An
autopar error (a damaged checkpoint directory, a failed save, a peer that died) is one line per
rank on stderr and exit status 1, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.zoo import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--tp", type=int, default=None, help="fix the tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=None, help="fix the pipeline-parallel degree")
    parser.add_argument("--checkpoint", default=None, help="folder for checkpoints (resumes from it)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints while training goes on")
    parser.add_argument(
        "--restart-from-scratch",
        action="store_true",
        help="train from step 0 when every checkpoint in --checkpoint is damaged (else: stop)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=None, help="how long a collective waits for a dead or hung rank"
    )
    parser.add_argument("--metrics-jsonl", default=None, help="per-step metrics as JSON lines (rank 0)")
    parser.add_argument("--tensorboard", default=None, help="TensorBoard log folder for the metrics")
    parser.add_argument(
        "--prometheus-port", type=int, default=None, help="serve the metrics on 127.0.0.1:PORT"
    )
    parser.add_argument("--max-grad-norm", type=float, default=None, help="clip the gradient norm to it")
    parser.add_argument(
        "--collectives-every", type=int, default=0, help="profile collectives on one step in N (N ≥ 2)"
    )
    parser.add_argument("--save-final", default=None, help="write the trained weights here (rank 0)")
    parser.add_argument("--plan-out", default=None, help="write the plan as JSON (for autopar report)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    autopar.init_distributed(args.timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=512, block_size=args.seq))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    preset = "dgx-h100" if torch.cuda.is_available() else "cpu"
    cluster = autopar.Cluster.preset(preset, nodes=world // per_node, gpus_per_node=per_node)
    fixed = autopar.Constraints(tp=args.tp, pp=args.pp)
    pm = autopar.parallelize(model, cluster, global_batch=args.global_batch, seq=args.seq, constraints=fixed)
    # TP is the innermost mesh axis: each TP group should sit inside one node (GROUP_RANK)
    nodes: list[int] = [0] * world
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", 0)))
    tp = pm.plan.strategy.tp
    inside = all(len(set(nodes[g : g + tp])) == 1 for g in range(0, world, tp))
    if rank == 0:
        print(pm.plan.text(), flush=True)
        if args.plan_out:
            Path(args.plan_out).write_text(pm.plan.to_json())
        print(f"tensor-parallel groups inside one node: {inside}", flush=True)
    ckpt = (
        autopar.Checkpointer(
            args.checkpoint,
            every=args.checkpoint_every,
            keep=args.keep,
            async_save=args.async_save,
            on_no_good="start" if args.restart_from_scratch else "stop",
        )
        if args.checkpoint
        else None
    )
    metrics = autopar.Metrics(
        pm,
        jsonl=args.metrics_jsonl,
        tensorboard=args.tensorboard,
        prometheus_port=args.prometheus_port,
        collectives_every=args.collectives_every,
    )
    dataset = torch.randint(0, 512, (1024, args.seq), generator=torch.Generator().manual_seed(0))
    batches = autopar.GlobalBatches(len(dataset), args.global_batch, seed=0)
    start = ckpt.resume(pm) if ckpt else 0
    print(f"rank {rank} pid {os.getpid()} starts at step {start}", flush=True)
    for step in range(start, args.steps):
        batch = dataset[batches.local(step, pm)]  # step k's batch depends on k only
        loss = pm.train_step(batch, max_grad_norm=args.max_grad_norm)
        m = metrics.step_done(step, loss)
        if rank == 0:
            print(
                f"step {step:3d}  loss {loss:.6f}  {m['tokens_per_s']:,.0f} tokens/s  MFU {m['mfu']:.1%}  "
                f"{m['step_time_over_predicted']:.2f}× predicted  "
                f"peak {m['peak_memory_bytes'] / 2**20:.0f} MiB",
                flush=True,
            )
        if ckpt is not None and ckpt.step_done(pm, step) and rank == 0:
            print(f"saved checkpoint step {step}" + (" (writing)" if args.async_save else ""), flush=True)
    metrics.close()
    if ckpt is not None:
        ckpt.close()  # a save in flight committed
    final = pm.full_state_dict()  # collective
    if args.save_final and rank == 0:
        torch.save({k: v.detach().clone() for k, v in final.items()}, args.save_final)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except autopar.AutoparError as e:  # one line per rank; torchrun sees the exit status
        line = str(e) if str(e).startswith("rank ") else f"rank {os.environ.get('RANK', '0')}: {e}"
        sys.stderr.write(line + "\n")  # one write: the ranks' lines don't interleave
        sys.stderr.flush()
        sys.exit(1)
