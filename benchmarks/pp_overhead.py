"""autopar's pipeline step time vs a hand-written ``torch.distributed.pipelining`` script (PP2, gloo, CPU).

    python benchmarks/pp_overhead.py [--steps 12]

Both train the same Llama on the same tokens with the same split (autopar's plan: its stage
boundaries are copied into the hand-written stages), the same schedule (1F1B) and the same
micro-batches. The hand-written script is what a torchtitan user writes: two stage modules
that hold the model's own submodules (embedding + first blocks; last blocks + norm + head),
a ``PipelineStage`` each and ``Schedule1F1B``. autopar splits the captured graph itself. The
median of the steps after 3 warm-up steps is compared, alternating the two step by step.
Target (pipeline issue): within 5%.
Prints the ratio and a summary line; exit status 1 if the ratio is above 1.05.
"""

from __future__ import annotations

import argparse
import sys

import torch
from timing import alternate, join, report, run_two  # benchmarks/timing.py
from torch import nn

from autopar import Cluster, Constraints, PlanRequest
from autopar.planner import make_plan
from autopar.runtime import lm_loss, parallelize
from autopar.zoo.llama import Llama, LlamaConfig

CFG = LlamaConfig(n_layer=4, dim=512, n_head=8, n_kv_head=4, ffn_dim=1024, vocab_size=1024, max_seq_len=128)
BATCH, MICRO, SEQ = 8, 2, 128


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Llama(CFG)


class FirstStage(nn.Module):
    """Embedding and the first blocks (hand-written: the forward is copied from the model)."""

    def __init__(self, model: Llama, blocks: int) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleList(model.layers[:blocks])
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[: tokens.shape[1]], self.rope_sin[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h  # type: ignore[no-any-return]


class LastStage(nn.Module):
    """The remaining blocks, final norm and output head."""

    def __init__(self, model: Llama, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(model.layers[blocks:])
        self.norm, self.output = model.norm, model.output
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_cos[: h.shape[1]], self.rope_sin[: h.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


def worker(rank: int, init: str, plan_json: str, steps: int, out: str) -> None:
    join(rank, init)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from autopar.plan import Plan

    plan = Plan.from_json(plan_json)
    first_blocks = len(plan.stages[0].recompute)
    data = torch.randint(0, CFG.vocab_size, (steps, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    model = make_model()
    module = FirstStage(model, first_blocks) if rank == 0 else LastStage(model, first_blocks)  # type: ignore[arg-type]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, BATCH // MICRO, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def hand_step(batch: torch.Tensor) -> None:
        if rank == 0:
            schedule.step(batch, return_outputs=False)
        else:
            schedule.step(target=batch, losses=[], return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)

    pm = parallelize(make_model(), plan)
    report(rank, alternate({"hand": hand_step, "autopar": pm.train_step}, data), out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with torch.device("meta"):
        meta = Llama(CFG)
    request = PlanRequest(
        model=meta,
        name="bench-llama",
        cluster=Cluster.preset("cpu"),
        global_batch=BATCH,
        seq=SEQ,
        dtype="fp32",
        constraints=Constraints(
            tp=1, pp=2, dp=1, zero=0, micro_batch=MICRO, recompute=("none",), schedule="1f1b"
        ),
    )
    plan = make_plan(request).plan
    print("\n".join(plan.text().splitlines()[:4]))
    times = run_two(worker, plan.to_json(), args.steps)
    ratio = times["autopar"] / times["hand"]
    print(
        f"autopar PP2 1F1B: {1e3 * times['autopar']:.1f} ms/step vs hand-written pipelining: "
        f"{1e3 * times['hand']:.1f} ms/step -> ratio {ratio:.3f}"
    )
    ok = ratio <= 1.05
    verdict = "met" if ok else "MISSED"
    print(f"summary: autopar PP2 within 5% of hand-written torch.distributed.pipelining: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
