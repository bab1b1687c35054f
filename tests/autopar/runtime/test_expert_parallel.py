"""Expert parallelism on 2 gloo processes against single-process training (float32: the MoE
families' grouped matmul has no float64 kernel), with checkpoints round-tripped and resumed
without EP, and the all-to-alls of each step counted against the cost model's."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.cluster import Cluster
from autopar.measure.verify import verify_cases
from autopar.planner import ModelProfiles, make_plan
from autopar.request import Constraints, PlanRequest
from autopar.zoo import hf

STEPS, BATCH, SEQ = 2, 4, 16
MICRO_BATCHES = 2  # per rank and step: 4 sequences over dp 2, micro-batch 1
MOE_LAYERS = 2  # the tiny configs' blocks, each a MoE layer


class CountAllToAll(TorchDispatchMode):
    """Counts the all-to-alls a rank runs: the count exchange (integer) and the row exchanges."""

    seen: ClassVar[Counter[str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "all_to_all_single" in str(func):
            self.seen["counts" if args[0].dtype == torch.int64 else "rows"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def expect_all_to_alls():
    """Per MoE layer and micro-batch the cost model prices one count exchange and two row
    exchanges in forward, two in backward (``cost_models.experts``): in the steps the hook sees,
    one count exchange per layer and micro-batch and four row exchanges for each."""
    CountAllToAll.seen = Counter()
    with CountAllToAll():
        yield
    counts, rows = CountAllToAll.seen["counts"], CountAllToAll.seen["rows"]
    assert counts == STEPS * MICRO_BATCHES * MOE_LAYERS, CountAllToAll.seen
    assert rows == 4 * counts, CountAllToAll.seen


def _plan(family: str, *, batch: int = BATCH, micro_batch: int = 1, ep: int = 2, **knobs: Any):
    with torch.device("meta"):
        meta = hf.family(family)
        profiles = ModelProfiles.of(hf.family(family), dtype="fp32", seq=SEQ)
    request = PlanRequest(
        model=meta,
        name=family,
        cluster=Cluster.preset("cpu", gpus_per_node=2),
        global_batch=batch,
        seq=SEQ,
        dtype="fp32",
        constraints=Constraints(tp=1, pp=1, dp=2, ep=ep, micro_batch=micro_batch, **knobs),
    )
    return make_plan(request, profiles).plan


def test_ep2_trains_like_one_process_and_round_trips_its_checkpoints(tmp_path) -> None:
    mixtral, qwen = functools.partial(hf.family, "mixtral"), functools.partial(hf.family, "qwen2-moe")
    cases = [
        (mixtral, _plan("mixtral", zero=1, recompute=("none",)), expect_all_to_alls),
        (qwen, _plan("qwen2-moe", zero=3, recompute=("full",)), None),
    ]
    for _, plan, _ in cases:
        assert plan.strategy.ep == 2 and plan.strategy.micro_batches == MICRO_BATCHES
    data = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    for (_, plan, _), v in zip(cases, verify_cases(cases, data, str(tmp_path)), strict=True):
        print(f"{plan.strategy.zero}: grad error {v.max_grad_error:.1e}, param {v.max_param_error:.1e}")
        assert v.passed, (plan.text(), v.first_failure)


def test_an_ep2_checkpoint_resumes_without_ep_and_loads_into_one_process(tmp_path) -> None:
    """Expert weights are saved as the global (E, …) tensors: an EP2 checkpoint (DP2 ZeRO-1,
    AdamW state included) resumes under DP2 ZeRO-3 without EP, the step after it gives the same
    weights (float32, within re-association rounding), and it loads into the unmodified model."""
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    from tests.autopar.runtime.test_state import layout_worker

    make = functools.partial(hf.family, "mixtral")
    data = torch.randint(0, 64, (2, 8, SEQ), generator=torch.Generator().manual_seed(3))
    path = str(tmp_path / "ckpt")

    knobs = {"batch": 8, "micro_batch": 2, "recompute": ("none",)}
    runs = ((_plan("mixtral", ep=2, zero=1, **knobs), False), (_plan("mixtral", ep=1, zero=3, **knobs), True))
    for i, (plan, load) in enumerate(runs):
        init = f"file://{tmp_path}/init{i}"
        mp.spawn(layout_worker, args=(2, init, plan.to_json(), data, path, load, make), nprocs=2, join=True)
    saved, loaded = torch.load(f"{path}.saved.pt"), torch.load(f"{path}.loaded.pt")
    assert set(saved) == set(loaded) and any(".experts." in k for k in saved)
    worst = max(float((saved[k] - loaded[k]).norm() / saved[k].norm().clamp_min(1e-30)) for k in saved)
    print(f"EP2 checkpoint resumed without EP: next step's weights within {worst:.1e} (relative)")
    assert worst <= 1e-5
    model = make()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert model.state_dict()[experts].shape == saved[experts].shape  # the global (E, …) tensor
