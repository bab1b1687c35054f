"""Expert parallelism on 2 gloo processes against single-process training (float32 for Hugging
Face's MoE families, whose grouped matmul has no float64 kernel; the zoo's runs in float64),
with checkpoints round-tripped and resumed without EP, and the all-to-alls of each step counted
against the cost model's."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.measure.verify import verify_cases
from autopar.zoo import hf
from autopar.zoo.configs import DeepSeekConfig, MixtralConfig
from autopar.zoo.deepseek import DeepSeekV3
from autopar.zoo.mixtral import Mixtral
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # 2- and 4-rank process groups

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
def expect_all_to_alls(recomputed: bool = False):
    """Per MoE layer and micro-batch the cost model prices one count exchange and two row
    exchanges in forward, two in backward, and the forward's again when the block is recomputed
    (``cost_models.experts``): what the steps the hook sees must run."""
    CountAllToAll.seen = Counter()
    with CountAllToAll():
        yield
    forwards = STEPS * MICRO_BATCHES * MOE_LAYERS * (2 if recomputed else 1)
    assert CountAllToAll.seen["counts"] == forwards, CountAllToAll.seen
    assert CountAllToAll.seen["rows"] == 2 * forwards + 2 * STEPS * MICRO_BATCHES * MOE_LAYERS, (
        CountAllToAll.seen
    )


def zoo_mixtral(capacity_factor: float | None = None) -> Mixtral:
    """The zoo's Mixtral, tiny: 2 MoE layers of 4 grouped experts, top-2 (the same weights on
    every call, as a model factory must give)."""
    torch.manual_seed(0)
    cfg = dict(n_layer=2, dim=32, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=64, max_seq_len=SEQ)
    return Mixtral(MixtralConfig(**cfg, n_experts=4, top_k=2, capacity_factor=capacity_factor))


def zoo_deepseek() -> DeepSeekV3:
    """The zoo's DeepSeek-V3, tiny: MLA, 2 MoE layers of 8 routed experts (top-3) and a shared one."""
    from tests.autopar.zoo.test_zoo import TINY_DEEPSEEK

    torch.manual_seed(0)
    return DeepSeekV3(DeepSeekConfig(**{**TINY_DEEPSEEK, "n_layer": 2, "n_dense_layers": 0}))


def _plan(
    family: str,
    *,
    batch: int = BATCH,
    micro_batch: int = 1,
    ep: int = 2,
    tp: int = 1,
    make=None,
    **knobs: Any,
):
    make = make or functools.partial(hf.family, family)
    knobs |= dict(tp=tp, pp=1, dp=2, ep=ep, micro_batch=micro_batch)
    return plan_for(make, batch=batch, seq=SEQ, name=family, gpus=2 * tp, **knobs)


def test_ep2_trains_like_one_process_and_round_trips_its_checkpoints(tmp_path) -> None:
    """Hugging Face's Mixtral and Qwen2-MoE, the zoo's Mixtral dropless and with a capacity that
    drops tokens (compared with one process running the same micro-batches: a token's fate
    depends on the micro-batch it is in, ``measure.arithmetic.batch_dependent``), the zoo's
    DeepSeek-V3 with selective recompute (its attention outlined beside the outlined experts)."""
    mixtral, qwen = functools.partial(hf.family, "mixtral"), functools.partial(hf.family, "qwen2-moe")
    zoo, capped = zoo_mixtral, functools.partial(zoo_mixtral, 0.5)
    recomputing = functools.partial(expect_all_to_alls, recomputed=True)
    deep = zoo_deepseek
    cases = [
        (mixtral, _plan("mixtral", zero=1, recompute=("none",)), expect_all_to_alls),
        (qwen, _plan("qwen2-moe", zero=3, recompute=("full",)), None),
        (zoo, _plan("zoo", make=zoo, zero=1, recompute=("none",)), expect_all_to_alls),
        (capped, _plan("capped", make=capped, zero=2, recompute=("full",)), recomputing),
        (deep, _plan("deepseek", make=deep, zero=3, recompute=("selective",)), expect_all_to_alls),
    ]
    for _, plan, _ in cases:
        assert plan.strategy.ep == 2 and plan.strategy.micro_batches == MICRO_BATCHES
    data = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    for (_, plan, _), v in zip(cases, verify_cases(cases, data, str(tmp_path)), strict=True):
        print(f"{plan.strategy.zero}: grad error {v.max_grad_error:.1e}, param {v.max_param_error:.1e}")
        assert v.passed, (plan.text(), v.first_failure)


def test_ep2_within_tp2_trains_like_one_process(tmp_path) -> None:
    """EP2 × TP2 on 4 ranks: attention split over tp (the memory objective splits every matmul
    it can), the experts split over ep and replicated over tp, each TP rank dispatching its copy
    of the rows within its own ep group; the zoo's Mixtral at ZeRO-1, Hugging Face's Mixtral at
    ZeRO-3 with sequence parallelism, and at ZeRO-1 with its own router loss
    (``output_router_logits``: ``runtime.loss.RouterAuxLoss``). The all-to-alls of each rank as
    without TP."""
    from tests.autopar.runtime.test_router_loss import mixtral_with_router_loss as aux

    mixtral = functools.partial(hf.family, "mixtral")
    tp2 = {"tp": 2, "tp_objective": "memory", "recompute": ("none",)}
    cases = [
        (zoo_mixtral, _plan("zoo", make=zoo_mixtral, zero=1, **tp2), expect_all_to_alls),
        (mixtral, _plan("mixtral", zero=3, sequence_parallel=True, **tp2), expect_all_to_alls),
        (aux, _plan("mixtral-aux", make=aux, zero=1, **tp2), None),  # its own router loss
    ]
    for _, plan, _ in cases:
        st = plan.strategy
        assert (st.ep, st.tp, st.dp) == (2, 2, 2) and st.micro_batches == MICRO_BATCHES
        assert any("column" in str(ops) for _, ops in plan.tensor_parallel)  # TP really splits
    data = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    for (_, plan, _), v in zip(
        cases, verify_cases(cases, data, str(tmp_path), checkpoint=False), strict=True
    ):
        print(f"EP2×TP2 ZeRO-{plan.strategy.zero}: grad error {v.max_grad_error:.1e}")
        assert v.passed, (plan.text(), v.first_failure)


def test_an_ep2_checkpoint_resumes_without_ep_and_loads_into_one_process(tmp_path) -> None:
    """Expert weights are saved as the global (E, …) tensors: an EP2 checkpoint (DP2 ZeRO-1,
    AdamW state included) resumes under DP2 ZeRO-3 without EP, the step after it gives the same
    weights (float32, within re-association rounding), and it loads into the unmodified model."""
    import torch.distributed.checkpoint as dcp

    from autopar.measure.launch import launch
    from tests.autopar.runtime.test_state import layout_worker

    make = functools.partial(hf.family, "mixtral")
    data = torch.randint(0, 64, (2, 8, SEQ), generator=torch.Generator().manual_seed(3))
    path = str(tmp_path / "ckpt")

    knobs = {"batch": 8, "micro_batch": 2, "recompute": ("none",)}
    runs = ((_plan("mixtral", ep=2, zero=1, **knobs), False), (_plan("mixtral", ep=1, zero=3, **knobs), True))
    for i, (plan, load) in enumerate(runs):
        init = f"file://{tmp_path}/init{i}"
        launch(layout_worker, args=(2, init, plan.to_json(), data, path, load, make), nprocs=2, join=True)
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
