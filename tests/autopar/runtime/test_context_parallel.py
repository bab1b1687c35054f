"""Context parallelism (``passes.context_parallel``) against one process: a causal Llama-style
zoo model and Hugging Face's Llama, unmodified, at cp 2 alone (DDP and ZeRO-3 over the cp ranks)
and with TP, with ZeRO-3 data parallelism, with a pipeline and with full recompute; a wrong
causal mask offset on the second chunk fails the verdict."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from autopar.measure.verify import verify_cases
from autopar.zoo import Llama, LlamaConfig, hf
from tests.conftest import plan_for

pytestmark = pytest.mark.slow  # 2- and 4-rank process groups

STEPS, BATCH, SEQ = 2, 4, 24
CFG = LlamaConfig(n_layer=2, dim=48, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=80, max_seq_len=64)


def llama() -> torch.nn.Module:
    """The zoo's Llama (GQA, rotary tables sliced to the input, ``is_causal`` attention), tiny."""
    torch.manual_seed(0)
    return Llama(CFG)


def hf_llama() -> torch.nn.Module:
    """Hugging Face's Llama, tiny: its causal mask built from positions, position ids from an arange."""
    return hf.llama(seq=64, vocab=80)


@contextlib.contextmanager
def wrong_second_chunk_mask() -> Iterator[None]:
    """The mutation: every chunk after the first sees half a chunk fewer keys than it should."""
    from autopar.passes import context_parallel as cpp

    right = cpp.visible_keys
    cpp.visible_keys = lambda g, c: g * c + c // 2 if g else c  # type: ignore[assignment]
    try:
        yield
    finally:
        cpp.visible_keys = right


def _verdicts(cases, tmp_path, *, checkpoint: bool = False) -> list:
    data = torch.randint(0, CFG.vocab_size, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return verify_cases(cases, data, str(tmp_path), checkpoint=checkpoint)


def test_cp2_matches_one_process_and_a_wrong_mask_fails(tmp_path) -> None:
    plans = {
        "zoo cp2 DDP": (llama, plan_for(llama, batch=BATCH, seq=SEQ, gpus=2, cp=2, dp=1, zero=0)),
        "zoo cp2 ZeRO-3": (llama, plan_for(llama, batch=BATCH, seq=SEQ, gpus=2, cp=2, dp=1, zero=3)),
        "HF cp2 ZeRO-3": (hf_llama, plan_for(hf_llama, batch=BATCH, seq=SEQ, gpus=2, cp=2, dp=1, zero=3)),
    }
    for _, plan in plans.values():
        assert plan.strategy.cp == 2 and plan.strategy.dims.mesh_dims == (
            ("pp", 1),
            ("dp", 1),
            ("cp", 2),
            ("tp", 1),
        )
    cases = [(make, plan, None) for make, plan in plans.values()]
    cases.append((llama, plans["zoo cp2 ZeRO-3"][1], wrong_second_chunk_mask))
    *good, bad = _verdicts(cases, tmp_path, checkpoint=True)  # each also saved, loaded and stepped again
    for name, v in zip(plans, good, strict=True):
        print(f"{name}: grad error {v.max_grad_error:.1e}, param {v.max_param_error:.1e}")
        assert v.passed, (name, v.first_failure)
    assert not bad.passed, "a causal mask offset wrong on the second chunk must fail"


def test_cp2_composes_with_tp_dp_and_pp(tmp_path) -> None:
    knobs = {
        "cp2 × tp2": dict(tp=2, dp=1, sequence_parallel=True),
        "cp2 × dp2 ZeRO-3": dict(dp=2, zero=3, micro_batch=1),
        "cp2 × pp2": dict(pp=2, dp=1, micro_batch=1),
    }
    hf_plans = {
        f"HF {k}": plan_for(hf_llama, batch=BATCH, seq=SEQ, gpus=4, cp=2, **v) for k, v in knobs.items()
    }
    plans = {
        "cp2 × tp2": plan_for(llama, batch=BATCH, seq=SEQ, gpus=4, cp=2, tp=2, dp=1, sequence_parallel=True),
        "cp2 × dp2 ZeRO-3": plan_for(llama, batch=BATCH, seq=SEQ, gpus=4, cp=2, dp=2, zero=3, micro_batch=1),
        "cp2 × pp2": plan_for(llama, batch=BATCH, seq=SEQ, gpus=4, cp=2, pp=2, dp=1, micro_batch=1),
        # the gather runs again in each recomputed block's forward
        "cp2 × dp2 full recompute": plan_for(
            llama, batch=BATCH, seq=SEQ, gpus=4, cp=2, dp=2, zero=2, micro_batch=1, recompute=("full",)
        ),
    }
    cases = [(llama, plan, None) for plan in plans.values()] + [
        (hf_llama, p, None) for p in hf_plans.values()
    ]
    verdicts = _verdicts(cases, tmp_path)
    for (name, plan), v in zip([*plans.items(), *hf_plans.items()], verdicts, strict=True):
        print(f"{name} ({plan.text().splitlines()[0]}): grad error {v.max_grad_error:.1e}")
        assert v.passed, (name, v.first_failure)
