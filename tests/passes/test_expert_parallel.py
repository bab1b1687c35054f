"""The expert-parallel rewrite's pieces on captured graphs (no processes): which nodes are a MoE
layer's experts, how received rows are regrouped, and the MoE forms it refuses.
(Training under EP against one process: tests/autopar/runtime/test_hf_families.py, ``ep2``.)"""

from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.graph import capture
from autopar.graph.experts import expert_groups, row_region
from autopar.passes.expert_parallel import _check_rows, by_local_expert
from autopar.zoo import GPT, GPTConfig, hf


def test_received_rows_are_regrouped_by_local_expert() -> None:
    # from source 0: 1 row for local expert 0, 2 for expert 1; from source 1: 3 for expert 0, none
    # for expert 1. Arrival order (source-major): 0 | 1 2 | 3 4 5 → by expert: 0 3 4 5 | 1 2
    received = torch.tensor([[1, 2], [3, 0]])
    assert by_local_expert(received).tolist() == [0, 3, 4, 5, 1, 2]
    assert by_local_expert(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


@pytest.mark.parametrize("family", ["mixtral", "deepseek-v3"])
def test_each_moe_layer_is_one_group_of_grouped_matmuls(family: str) -> None:
    cap = capture(hf.family(family), batch=1, seq=16)
    groups = expert_groups(cap.gm)
    assert len(groups) == 2  # the tiny configs' two blocks
    for k, g in enumerate(groups):
        assert g.experts == 4 and len(g.matmuls) == 2  # gate-up, down
        assert g.path == f"model.layers.{k}.mlp.experts"
        assert g.rows == 16 * 2  # tokens × top-2
        region = row_region(cap.gm, g)
        assert g.first in region and g.last in region
        _check_rows(g, region)  # every operator between them is row-wise: accepted
        assert g.first.meta["autopar.fwd_flops"] == 2 * 32 * 64 * g.weights[0].meta["val"].shape[-2]


def test_a_dense_model_has_no_experts() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    assert expert_groups(capture(model, batch=1, seq=16).gm) == []


def test_rows_read_from_outside_the_experts_are_refused() -> None:
    """A row-shaped tensor computed before the experts and read between their matmuls would be
    misaligned with the rows dispatch moves: refused with the node named."""
    cap = capture(hf.family("mixtral"), batch=1, seq=16)
    g = expert_groups(cap.gm)[0]
    region = row_region(cap.gm, g)
    graph = cap.gm.graph
    act = next(n for n in region if n.target == torch.ops.aten.silu.default)
    with graph.inserting_after(act):
        mixed = graph.call_function(torch.ops.aten.mul.Tensor, (act, g.first.args[0]))
    mixed.meta["val"] = act.meta["val"]
    act.replace_all_uses_with(mixed, delete_user_cb=lambda u: u is not mixed)
    with pytest.raises(AutoparError, match="rows from outside the experts"):
        _check_rows(g, row_region(cap.gm, g))
