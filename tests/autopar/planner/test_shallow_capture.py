"""Built-in models are captured as a shallow copy (``profiles.CAPTURED_BLOCKS`` blocks) and
deepened: the profile and the plans equal those of capturing the whole model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import Cluster, Constraints, PlanRequest
from autopar.cost_models.profile import ModelProfile
from autopar.graph import capture
from autopar.planner import ModelProfiles, make_plan
from autopar.planner.profiles import CAPTURED_BLOCKS
from autopar.zoo import ZOO
from autopar.zoo.spec import resolve


@pytest.mark.parametrize(("spec", "seq"), [("gpt2", 256), ("llama3-8b", 256), ("mixtral-8x7b", 128)])
def test_deepened_profile_equals_the_whole_capture(spec: str, seq: int) -> None:
    shallow = ModelProfiles.of(spec, dtype="bf16", seq=seq).at(1)
    whole = ModelProfile.from_captured(capture(resolve(spec, dtype="bf16").module, batch=1, seq=seq))
    assert len(shallow.captured.layers) == CAPTURED_BLOCKS + 2 < len(whole.layers)  # really shallow
    assert shallow.blocks == ZOO[spec].config.n_layer
    assert shallow == whole  # every field but the graph: costs, layers, names, parameters


@pytest.mark.slow
def test_runs_of_unlike_blocks_are_deepened_run_by_run() -> None:
    """DeepSeek-V3's shape: dense blocks, then MoE blocks; a copy with two of each, deepened to
    3 and 5, equals the capture of all 8."""
    import torch

    from autopar.zoo import DeepSeekConfig, DeepSeekV3
    from tests.autopar.zoo.test_zoo import TINY_DEEPSEEK

    def captured(dense: int, layers: int) -> ModelProfile:
        with torch.device("meta"):
            model = DeepSeekV3(
                DeepSeekConfig(**{**TINY_DEEPSEEK, "n_dense_layers": dense, "n_layer": layers})
            )
        return ModelProfile.from_captured(capture(model, batch=1, seq=16))

    shallow, whole = captured(2, 4), captured(3, 8)
    assert len(set(whole.layers[1:-1])) == 2
    assert shallow.deepened((3, 5)) == whole
    assert shallow.deepened(8) is None  # two runs, not one


def test_a_profile_that_cannot_be_deepened() -> None:
    profile = ModelProfiles.of("gpt2", dtype="bf16", seq=64).at(1)
    edges = (profile.layers[0], profile.layers[-1])
    two_types = replace(profile, layers=(edges[0], "a", "b", edges[1]), layer_names=("e", "h.0", "h.1", "o"))
    assert two_types.deepened(8) is None
    block = profile.layers[1]
    renamed = replace(profile, layers=(edges[0], block, block, edges[1]), layer_names=("e", "x", "y", "o"))
    assert renamed.deepened(8) is None  # not <prefix><index>
    named = replace(renamed, layer_names=("e", "h.0", "h.1", "o")).deepened(4)
    assert named is not None and named.layer_names == ("e", "h.0", "h.1", "h.2", "h.3", "o")


@pytest.mark.slow
@pytest.mark.parametrize(
    "constraints",
    [
        Constraints(tp=2, pp=2, recompute=("none", "full", "sac")),
        Constraints(tp=4, sequence_parallel=True, zero=3),
        Constraints(),
    ],
)
def test_plans_equal_those_of_the_whole_capture(constraints: Constraints) -> None:
    request = PlanRequest(
        model="llama3-8b",
        cluster=Cluster.preset("dgx-h100", nodes=2),
        global_batch=32,
        seq=1024,
        dtype="bf16",
        constraints=constraints,
    )
    whole = ModelProfiles.of(resolve("llama3-8b", dtype="bf16").module, dtype="bf16", seq=1024)
    a = make_plan(request, ModelProfiles.of("llama3-8b", dtype="bf16", seq=1024)).plan.to_dict()
    b = make_plan(request, whole).plan.to_dict()
    for d in (a, b):
        d.pop("solve_time_s")
    assert a == b


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2-moe", "gemma2"])
def test_a_hugging_face_model_is_captured_as_two_blocks_and_deepened(name: str) -> None:
    """A model with a ``config.num_hidden_layers`` is rebuilt with two blocks (``shallow_copy``)
    and deepened: the same profile as capturing all its blocks."""
    import torch

    from autopar.planner.profiles import shallow_copy
    from autopar.zoo import hf

    with torch.device("meta"):
        model = hf.family(name, layers=4)
    copied = shallow_copy(model)
    assert copied is not None and copied[1] == 4
    deep = ModelProfile.from_captured(capture(copied[0], batch=1, seq=16)).deepened(copied[1])
    assert deep == ModelProfile.from_captured(capture(model, batch=1, seq=16))


def test_a_model_whose_blocks_differ_is_captured_whole() -> None:
    """DeepSeek-V3's first dense layers: blocks of one class with different parameters."""
    import torch
    import transformers

    from autopar.planner.profiles import shallow_copy

    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(cfg)
        alike = transformers.DeepseekV3ForCausalLM(replace(cfg, first_k_dense_replace=0))
    assert shallow_copy(model) is None
    assert shallow_copy(alike) is not None  # the same config with every block routed: rebuilt
