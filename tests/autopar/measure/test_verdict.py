"""The verify verdict: correct plans pass in float64 and in half precision (AdamW, PyTorch's default
initialisation); plans broken on purpose fail and the verdict names the step and parameter."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch

from autopar.measure.ranks import spawn_plans
from autopar.measure.verdict import BOUNDS, Trace, judge
from autopar.measure.verify import HALF, arithmetic_of, run_reference
from autopar.plan import Plan
from autopar.strategy import SHARDING
from autopar.zoo import GPT, GPTConfig, hf
from tests.conftest import default_init, plan_for

STEPS, BATCH, SEQ = 3, 8, 16


def default_init_gpt(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A 4-block GPT (tied embedding and head) with PyTorch's default initialisation, wide
    enough that the per-operator ILP shards it at tp 2."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=96, block_size=SEQ))
    return default_init(model).to(dtype)


def _float32(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make()`` in float32: the model the plans are made for (the checks run it in float64)."""
    return make().float()


def _plan(dtype: str = "fp32", model=None, **knobs) -> Plan:
    make = functools.partial(_float32, model or default_init_gpt)
    return plan_for(make, batch=BATCH, seq=SEQ, dtype=dtype, gpus=2, **knobs)


# ---- mutations: each breaks a plan on purpose (run inside the worker around the plan) --------


def _scale_grads_after_backward(factor_of) -> contextlib.AbstractContextManager[None]:
    from autopar.runtime.model import ParallelModel

    original = ParallelModel.backward

    def backward(self, batch):
        losses = original(self, batch)
        for stage in self.stages:
            for p in stage.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor_of(self.plan.strategy))
        return losses

    return mock.patch.object(ParallelModel, "backward", backward)


@contextlib.contextmanager
def sum_dp_gradients() -> Iterator[None]:
    """The data-parallel gradients summed instead of averaged."""
    with _scale_grads_after_backward(lambda st: st.dp):
        yield


@contextlib.contextmanager
def forget_micro_batch_division() -> Iterator[None]:
    """Each micro-batch's loss not divided by the number of micro-batches."""
    with _scale_grads_after_backward(lambda st: st.micro_batches):
        yield


@contextlib.contextmanager
def drop_tp_all_reduce() -> Iterator[None]:
    """Megatron's g (the row-parallel output all-reduce) left out."""
    from autopar.passes.tp_collectives import _Reduce

    with mock.patch.object(_Reduce, "forward", staticmethod(lambda ctx, x, group: x.clone())):
        yield


@contextlib.contextmanager
def skip_tied_gradient_sum() -> Iterator[None]:
    """The tied embedding/head gradients not summed across the pipeline stages."""
    with mock.patch("autopar.runtime.apply_tied_groups", lambda *args, **kwargs: []):
        yield


@contextlib.contextmanager
def double_loss_scale_on_one_rank() -> Iterator[None]:
    """fp16: rank 1 scales its loss twice as much as the scaler says."""
    import torch.distributed as dist

    original = torch.amp.GradScaler.scale

    def scale(self, outputs):
        scaled = original(self, outputs)
        return scaled * 2 if dist.get_rank() == 1 else scaled

    with mock.patch.object(torch.amp.GradScaler, "scale", scale):
        yield


@contextlib.contextmanager
def overflow_on_rank_one() -> Iterator[None]:
    """fp16: rank 1's first loss is so large that its scaled gradients overflow."""
    import torch.distributed as dist

    from autopar.runtime.schedules import LocalSchedule

    original, calls = LocalSchedule.step, []

    def step(self, runner, batch):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 1:
            loss_fn = runner.loss_fn
            with mock.patch.object(runner, "loss_fn", lambda out, b: loss_fn(out, b) * 1e38):
                return original(self, runner, batch)
        return original(self, runner, batch)

    with mock.patch.object(LocalSchedule, "step", step):
        yield


@contextlib.contextmanager
def weigh_micro_batches_unevenly() -> Iterator[None]:
    """Every other micro-batch's loss counted twice (the weights of a step's losses uneven)."""
    from autopar.measure import ranks
    from autopar.runtime import lm_loss

    original, calls = ranks.resolve_loss, []

    def resolve(spec):
        loss_fn = original(spec) or lm_loss  # (the default for this model: it returns logits)

        def weighed(out, batch):
            calls.append(1)
            return loss_fn(out, batch) * (2 if len(calls) % 2 else 1)

        return weighed

    with mock.patch.object(ranks, "resolve_loss", resolve):
        yield


@contextlib.contextmanager
def shift_stage_boundary() -> Iterator[None]:
    """The last layer of the first pipeline chunk runs in the second, which holds freshly
    initialised weights for it instead of the model's (the boundary moved, its weights did not)."""
    from autopar.runtime import steps
    from autopar.runtime.state import fqn

    chunks_of, split, moved = steps.stage_chunks, steps.split_stages, []

    def shifted(*args, **kwargs):
        chunks = chunks_of(*args, **kwargs)
        moved.append(chunks[0].pop())
        chunks[1].insert(0, moved[-1])
        return chunks

    @torch.no_grad()
    def split_without_weights(*args, **kwargs):
        stages = split(*args, **kwargs)
        for module in stages.values():
            for name, p in module.named_parameters():
                if fqn(name).startswith(moved[-1] + "."):
                    p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
        return stages

    with (
        mock.patch.object(steps, "stage_chunks", shifted),
        mock.patch.object(steps, "split_stages", split_without_weights),
    ):
        yield


def _launch(make, plans, hooks, tmp_path, raw=None):
    """One launch of ``plans`` (with ``hooks``); each judged against the single process in its
    arithmetic (``raw``: the runs' records, appended). No checkpoint round trip: the mutations
    here break training, not checkpoints, which the runtime tests round-trip."""
    data = torch.randint(0, 96, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    results = spawn_plans(make, plans, data, str(tmp_path), hooks=hooks, checkpoint=False)
    if raw is not None:
        raw.extend(results)
    references: dict[str, Trace] = {}
    verdicts = []
    for plan, got in zip(plans, results, strict=True):
        arithmetic = arithmetic_of(plan.strategy.dtype)
        if arithmetic not in references:
            references[arithmetic] = run_reference(make, data, STEPS, autocast=HALF.get(arithmetic))
        verdicts.append(judge(references[arithmetic], got, arithmetic))
    return verdicts


@pytest.mark.slow
def test_correct_plans_pass_and_broken_ones_fail_naming_the_parameter(tmp_path) -> None:
    # 1F1B: the boundary mutation moves the first chunk's last layer (interleaved plans may
    # hold the embedding alone in it)
    ddp, pp = _plan(tp=1, pp=1, dp=2, zero=0), _plan(tp=1, pp=2, dp=1, schedule="1f1b")
    tp = _plan(tp=2, pp=1, dp=1, sequence_parallel=False)  # row-parallel outputs all-reduced (g)
    assert any(n in SHARDING for _, ops in tp.tensor_parallel for _, n, _ in ops)  # TP really shards
    assert ddp.strategy.micro_batches == 2
    cases = [
        (ddp, None),
        (ddp, sum_dp_gradients),
        (ddp, forget_micro_batch_division),
        (tp, None),
        (tp, drop_tp_all_reduce),
        (pp, None),
        (pp, skip_tied_gradient_sum),
        (pp, weigh_micro_batches_unevenly),
        (pp, shift_stage_boundary),
    ]  # ZeRO and interleaving pass the verdict in the 4-rank test below and in the runtime tests
    verdicts = _launch(default_init_gpt, [p for p, _ in cases], [h for _, h in cases], tmp_path)
    for (plan, hook), v in zip(cases, verdicts, strict=True):
        name = hook.__name__ if hook else "correct"
        print(
            f"{plan.text().splitlines()[0]} [{name}]: grad error {v.max_grad_error:.1e} -> {v.first_failure}"
        )
        if hook is None:
            assert v.passed and v.max_grad_error <= BOUNDS["float64"][1], (name, v.first_failure)
        else:
            assert not v.passed and "step 0" in str(v.first_failure) and "'" in str(v.first_failure), name
    assert "wte.weight" in str(verdicts[6].first_failure) or "lm_head" in str(verdicts[6].first_failure)


@pytest.mark.slow
def test_half_precision_plan_passes_and_a_wrong_loss_scale_fails(tmp_path) -> None:
    """fp16 DDP and bf16 TP2 pass against an autocast reference (parameters included); one rank's
    doubled loss scale fails; an overflow on one rank makes every rank skip that step and halve
    its scale."""
    plan = _plan(dtype="fp16", tp=1, pp=1, dp=2, zero=0)
    tp = _plan(dtype="bf16", tp=2, pp=1, dp=1, sequence_parallel=True)
    make = functools.partial(default_init_gpt, torch.float32)
    raw: list[dict] = []
    hooks = [None, double_loss_scale_on_one_rank, overflow_on_rank_one, None]
    good, bad, overflow, bf16_tp = _launch(make, [plan] * 3 + [tp], hooks, tmp_path, raw)
    print(f"bf16 TP2+SP: grad error {bf16_tp.max_grad_error:.1e}, loss error {bf16_tp.max_loss_error:.1e}")
    assert bf16_tp.passed and bf16_tp.max_grad_error > 0, bf16_tp.first_failure  # bf16 really ran
    print(
        f"fp16 DDP: grad error {good.max_grad_error:.1e}; one rank's loss scale doubled: {bad.first_failure}"
    )
    assert good.passed, good.first_failure
    assert not bad.passed and "gradient of" in str(bad.first_failure)
    normal, first, second = raw[0]["scales"][0], raw[2]["scales"][0], raw[2]["scales"][1]
    print(f"overflow on rank 1: every rank's scale after it {first} (else {normal}), then {second}")
    assert first == [normal[0] / 2] * 2 and second == first
    initial = _initial(make)
    assert all(torch.equal(raw[2]["params"][0][k], initial[k]) for k in raw[2]["params"][0] if k in initial)
    assert not overflow.passed  # the skipped step is not the reference's


def _initial(make) -> dict[str, torch.Tensor]:
    """The weights ``make`` builds (seeded: the same on every rank and in the reference)."""
    return {k: v.detach().clone() for k, v in make().state_dict().items()}


def _trace(grads: dict[str, torch.Tensor], lr: float = 0.1) -> Trace:
    before = {k: torch.zeros_like(v) for k, v in grads.items()}
    after = {k: -lr * g for k, g in grads.items()}
    return Trace(losses=[1.0], state=after, grads=[grads], params=[after], initial=before)


def test_the_verdict_is_relative_to_each_parameter_and_names_it() -> None:
    ref = _trace({"big": torch.ones(100), "small": torch.full((4,), 1e-6)})

    def run(grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor] | None = None) -> dict:
        after = params if params is not None else _trace(grads).params[0]
        return {"losses": [1.0], "grads": [grads], "params": [after]}

    assert judge(ref, run(ref.grads[0]), "float64").passed
    halved = {"big": torch.ones(100), "small": torch.full((4,), 5e-7)}  # tiny against "big", yet wrong
    v = judge(ref, run(halved), "float64")
    assert not v.passed and "'small'" in str(v.first_failure) and "gradient" in str(v.first_failure)
    frozen = {"big": ref.params[0]["big"], "small": torch.zeros(4)}  # right gradient, never applied
    v = judge(ref, run(ref.grads[0], frozen), "float64")
    assert not v.passed and "'small'" in str(v.first_failure) and "after the step" in str(v.first_failure)
    assert not judge(ref, run({"big": torch.ones(100)}), "float64").passed  # a missing gradient
    assert not judge(ref, run(ref.grads[0], frozen), "bf16").passed  # did not move at all


def test_the_gradient_norm_is_checked_each_step() -> None:
    ref = _trace({"w": torch.full((4,), 1.0)})._replace(norms=(2.0,))
    run = {"losses": [1.0], "grads": ref.grads, "params": ref.params}
    assert judge(ref, {**run, "grad_norms": [2.0]}, "float64").passed
    v = judge(ref, {**run, "grad_norms": [2.0 * (1 + 1e-6)]}, "float64")
    assert not v.passed and "the gradient norm" in str(v.first_failure)
    assert judge(ref, {**run, "grad_norms": [math.inf]}, "fp16").passed  # fp16 overflow: step skipped


@pytest.mark.parametrize("arithmetic", ["float64", "bf16", "fp16"])
def test_bounds_are_stated_per_arithmetic(arithmetic: str) -> None:
    loss, grad, param = BOUNDS[arithmetic]
    assert 0 < grad < 1 and 0 < loss < 1 and 0 < param <= 0.5


def _plan4(**knobs) -> Plan:
    make = functools.partial(default_init_gpt, torch.float32)
    return plan_for(make, batch=BATCH, seq=SEQ, dtype="bf16", gpus=4, **{"micro_batch": 1, **knobs})


@pytest.mark.slow
def test_zero_and_interleaving_with_tp_and_pp_pass_on_four_ranks(tmp_path) -> None:
    """The combinations the two-rank tests don't reach, under AdamW on default-initialised
    weights, checked in float64 in one 4-rank launch (their checkpoints round-trip in the 2-rank
    pipeline and state tests)."""
    plans = [
        _plan4(tp=2, pp=1, dp=2, zero=1),
        _plan4(tp=1, pp=2, dp=2, zero=2),
        _plan4(tp=1, pp=2, dp=2, zero=1, schedule="interleaved", virtual_stages=2),
        _plan4(tp=2, pp=2, dp=1, schedule="interleaved", virtual_stages=2),
    ]
    for plan, v in zip(plans, _launch(default_init_gpt, plans, None, tmp_path), strict=True):
        print(
            f"{plan.text().splitlines()[0]} ZeRO-{plan.strategy.zero} {plan.strategy.schedule}: "
            f"grad error {v.max_grad_error:.1e}, parameter error {v.max_param_error:.1e}"
        )
        assert v.passed, (plan.text(), v.first_failure)


# ---- dropout: compared with it off; with it on, replicas agree and recompute replays masks ----


def dropout_gpt() -> torch.nn.Module:
    """``default_init_gpt`` with dropout 0.1 everywhere, attention written out (its dropout on the
    head-sharded scores under TP)."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=4, n_embd=256, n_head=4, vocab_size=96, block_size=SEQ, dropout=0.1, attention="math"
    )
    return default_init(GPT(cfg)).double()


@contextlib.contextmanager
def unsynced_tp_rng() -> Iterator[None]:
    """The TP ranks keep their own random state (seeded by rank): their replicated activations
    draw different dropout masks."""
    with mock.patch("autopar.runtime.agree_on_rng", lambda group: None):
        yield


@contextlib.contextmanager
def recompute_with_fresh_masks() -> Iterator[None]:
    """Recomputation draws new dropout masks instead of replaying the forward's."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    original = cw.checkpoint_wrapper
    with mock.patch.object(cw, "checkpoint_wrapper", lambda m: original(m, preserve_rng_state=False)):
        yield


@pytest.mark.slow
def test_dropout_plans_pass_and_unreplayed_or_unsynced_masks_fail(tmp_path) -> None:
    from autopar.measure.verify import draws_masks, verify_runs
    from autopar.runtime import lm_loss

    data = torch.randint(0, 96, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    assert draws_masks(dropout_gpt, lm_loss, data[0]) and not draws_masks(default_init_gpt, lm_loss, data[0])
    # a router that samples its experts (PhiMoE) is random too: one row under two seeds missed it
    assert draws_masks(functools.partial(hf.family, "phimoe"), lm_loss, data[0] % 64)
    tp = _plan(model=dropout_gpt, tp=2, pp=1, dp=1, sequence_parallel=False)
    pp = _plan(model=dropout_gpt, tp=1, pp=2, dp=1, recompute=("full",))
    assert set(pp.recompute.values()) == {"full"}
    cases = [(tp, None), (tp, unsynced_tp_rng), (pp, None), (pp, recompute_with_fresh_masks)]
    verdicts = verify_runs(dropout_gpt, cases, data, str(tmp_path), checkpoint=False)
    for (plan, hook), v in zip(cases, verdicts, strict=True):
        name = hook.__name__ if hook else "correct"
        print(f"{plan.text().splitlines()[0]} dropout 0.1 [{name}]: {v.dropout}; {v.first_failure or 'PASS'}")
        assert v.dropout is not None and v.max_grad_error <= BOUNDS["float64"][1], name  # dropout off: exact
    assert verdicts[0].passed and verdicts[2].passed, (verdicts[0].first_failure, verdicts[2].first_failure)
    assert "recompute replays" in str(verdicts[2].dropout)
    assert not verdicts[1].passed and "differs between the ranks" in str(verdicts[1].first_failure)
    assert not verdicts[3].passed and "recompute does not replay" in str(verdicts[3].first_failure)
    assert "'" in str(verdicts[3].first_failure)


def test_a_compiled_plans_round_trip_allows_a_last_bit_step_but_not_a_lost_state() -> None:
    """A compiled plan's fresh placement runs its own compiled kernels: its next step may differ
    within ``COMPILED_STEP_GAP`` where its state came back exactly; an eager plan's may not."""
    from autopar.measure.verdict import COMPILED_STEP_GAP, run_failure

    base = {"checkpoint_exact": False, "checkpoint_state_exact": True, "checkpoint_step_gap": 1e-5}
    assert run_failure({**base, "checkpoint_compiled": True}) is None
    assert run_failure({**base, "checkpoint_compiled": False}) is not None
    assert run_failure({**base, "checkpoint_compiled": True, "checkpoint_state_exact": False}) is not None
    far = {**base, "checkpoint_compiled": True, "checkpoint_step_gap": 10 * COMPILED_STEP_GAP}
    assert run_failure(far) is not None


def test_a_batch_dependent_model_is_compared_with_its_own_micro_batches() -> None:
    """Experts with a capacity drop tokens by their place in the batch, so the reference runs the
    plan's micro-batches; a model whose rows are independent gets the same reference either way."""
    from autopar.measure.arithmetic import batch_dependent
    from autopar.zoo.configs import MixtralConfig
    from autopar.zoo.mixtral import Mixtral

    def mixtral(capacity_factor: float | None) -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = dict(n_layer=1, dim=32, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=64, max_seq_len=16)
        return Mixtral(MixtralConfig(**cfg, n_experts=4, top_k=2, capacity_factor=capacity_factor)).double()

    data = torch.randint(0, 64, (1, 4, 16), generator=torch.Generator().manual_seed(0))
    dropless, capped = functools.partial(mixtral, None), functools.partial(mixtral, 0.5)
    assert not batch_dependent(dropless, None, data[0, :2])
    assert batch_dependent(capped, None, data[0, :2])
    whole, parts = run_reference(dropless, data, 1), run_reference(dropless, data, 1, micro_rows=2)
    assert abs(whole.losses[0] - parts.losses[0]) < 1e-12
    for k, g in whole.grads[0].items():
        assert torch.allclose(g, parts.grads[0][k], rtol=1e-10, atol=1e-14), k
    whole, parts = run_reference(capped, data, 1), run_reference(capped, data, 1, micro_rows=2)
    assert abs(whole.losses[0] - parts.losses[0]) > 1e-6  # other tokens dropped
