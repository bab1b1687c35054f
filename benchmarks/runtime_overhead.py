"""autopar's data-parallel step time vs hand-written DDP and FSDP2 scripts (world 2, gloo, CPU).

    python benchmarks/runtime_overhead.py [--steps 12]

Each variant trains the same GPT on the same tokens; the median of the steps
after 3 warm-up steps is compared, in one run. Target (runtime issue): autopar
within 5% of the hand-written script for DP (ZeRO-0) and for ZeRO-3. Prints the
ratios and a summary line; exit status 1 if a ratio is above 1.05.
"""

from __future__ import annotations

import argparse
import sys

import torch
from timing import alternate, join, report, run_two  # benchmarks/timing.py

from autopar import Cluster, Constraints, PlanRequest
from autopar.planner import ModelProfiles, make_plan
from autopar.runtime import lm_loss, parallelize
from autopar.zoo import GPT, GPTConfig

CFG = GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=1024, block_size=128)
BATCH, SEQ = 8, 128


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(CFG)


def hand_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    lm_loss(model(batch), batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(rank: int, init: str, plans: dict[str, str], steps: int, out: str) -> None:
    join(rank, init)
    from autopar.plan import Plan

    data = torch.randint(0, CFG.vocab_size, (steps, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    local = data[:, rank * BATCH // 2 : (rank + 1) * BATCH // 2]
    times: dict[str, float] = {}

    def timed_pair(names: tuple[str, str], fns: tuple) -> None:  # type: ignore[type-arg]
        """Alternate the two variants step by step so both see the same machine state."""
        times.update(alternate(dict(zip(names, fns, strict=True)), local))

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(make_model())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    pm = parallelize(make_model(), Plan.from_json(plans["zero0"]))
    timed_pair(("hand DDP", "autopar ZeRO-0"), (lambda b: hand_step(ddp, opt, b), pm.train_step))
    fsdp = make_model()
    for block in fsdp.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(fsdp, reshard_after_forward=True)
    opt3 = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    pm3 = parallelize(make_model(), Plan.from_json(plans["zero3"]))
    timed_pair(("hand FSDP2", "autopar ZeRO-3"), (lambda b: hand_step(fsdp, opt3, b), pm3.train_step))
    report(rank, times, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with torch.device("meta"):
        meta = GPT(CFG)
    prof = ModelProfiles.of(meta, dtype="fp32", seq=SEQ)

    def request(zero: int) -> PlanRequest:
        fixed = Constraints(tp=1, pp=1, dp=2, zero=zero, micro_batch=BATCH // 2, recompute=("none",))
        return PlanRequest(
            model=meta,
            name="bench-gpt",
            cluster=Cluster.preset("cpu"),
            global_batch=BATCH,
            seq=SEQ,
            dtype="fp32",
            constraints=fixed,
        )

    plans = {f"zero{z}": make_plan(request(z), prof).plan.to_json() for z in (0, 3)}
    times = run_two(worker, plans, args.steps)
    ok = True
    for mine, hand in (("autopar ZeRO-0", "hand DDP"), ("autopar ZeRO-3", "hand FSDP2")):
        ratio = times[mine] / times[hand]
        ok &= ratio <= 1.05
        print(
            f"{mine}: {1e3 * times[mine]:.1f} ms/step vs {hand}: {1e3 * times[hand]:.1f} ms/step "
            f"-> ratio {ratio:.3f}"
        )
    print(f"summary: autopar within 5% of hand-written DP and FSDP2 scripts: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
