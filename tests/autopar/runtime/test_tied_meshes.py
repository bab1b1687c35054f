"""Tied embedding and head across pipeline stages on the 4-D meshes (``ParallelDims``): the
tied weight's gradient is summed over one group per rank of a stage, whatever dims split the
data axis. PP2 × EP2 × TP2 on Hugging Face's Mixtral with ``tie_word_embeddings`` (8 processes)
and PP2 × HSDP (2 × 2) × TP2 on the zoo's GPT (16 processes), each against one process."""

from __future__ import annotations

import functools

import pytest
import torch

from autopar.measure.verify import verify_cases
from autopar.zoo import GPT, GPTConfig, hf
from tests.conftest import default_init, plan_for

pytestmark = pytest.mark.slow  # 8- and 16-rank process groups

STEPS, SEQ = 2, 16


def tied_mixtral() -> torch.nn.Module:
    """Hugging Face's Mixtral, tiny (2 MoE layers of 4 experts, top-2), head tied to the embedding."""
    return hf.family("mixtral", seq=SEQ, tie_word_embeddings=True)


def tied_gpt() -> torch.nn.Module:
    """The zoo's GPT (head tied to the token embedding), 4 blocks."""
    torch.manual_seed(0)
    return default_init(GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=64, block_size=SEQ)))


def _check(make, plan, batch: int, tmp_path) -> None:
    data = torch.randint(0, 64, (STEPS, batch, SEQ), generator=torch.Generator().manual_seed(5))
    (v,) = verify_cases([(make, plan, None)], data, str(tmp_path), checkpoint=False)
    print(f"{plan.text().splitlines()[0]}: grad error {v.max_grad_error:.1e}, param {v.max_param_error:.1e}")
    assert v.passed, (plan.text(), v.first_failure)


def test_tied_moe_under_pp2_ep2_tp2(tmp_path) -> None:
    batch = 8
    lean = {"tp_objective": "memory"}  # the embedding split by vocabulary, the tied head by column
    plan = plan_for(tied_mixtral, batch=batch, seq=SEQ, pp=2, dp=2, tp=2, ep=2, zero=1, micro_batch=1, **lean)
    st = plan.strategy
    assert {"vocab", "column"} <= {name for _, ops in plan.tensor_parallel for _, name, _ in ops}
    assert st.dims.mesh_dims == (("pp", 2), ("edp", 1), ("ep", 2), ("tp", 2))
    _check(tied_mixtral, plan, batch, tmp_path)


def test_tied_gpt_under_pp2_hsdp_tp2(tmp_path) -> None:
    batch = 8
    make = functools.partial(tied_gpt)
    knobs = {"zero": 2, "dp_replicate": 2, "micro_batch": 1, "tp_objective": "memory"}
    plan = plan_for(make, batch=batch, seq=SEQ, pp=2, dp=4, tp=2, **knobs)
    assert {"vocab", "column"} <= {name for _, ops in plan.tensor_parallel for _, name, _ in ops}
    assert plan.strategy.dims.mesh_dims == (("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))
    _check(make, plan, batch, tmp_path)
