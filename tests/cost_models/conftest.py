"""Shared fixtures of the cost-model tests."""

from __future__ import annotations

import pytest
import torch

from autopar.planner import ModelProfiles
from autopar.zoo import GPT, GPTConfig

SMALL_GPT_SEQ = 128


@pytest.fixture(scope="session")
def small_gpt_profile():
    """A 4-block GPT (width 256, vocab 4096) captured in bf16 at micro-batch 1, seq 128."""
    cfg = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, block_size=SMALL_GPT_SEQ)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    return ModelProfiles.of(model, dtype="bf16", seq=SMALL_GPT_SEQ).at(1)
