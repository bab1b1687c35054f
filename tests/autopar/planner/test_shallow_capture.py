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
