"""Regional compilation as a planned knob: off unless asked, both priced under ``--compile
auto`` and the faster kept, fixed by a constraint; what a compute profile measured prices only
plans compiled as it was."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autopar import AutoparError, Cluster, Constraints, PlanRequest
from autopar.cli import main
from autopar.cost_models.estimate import estimate
from autopar.planner import ModelProfiles, make_plan
from autopar.planner.search import outer_strategies
from autopar.strategy import Strategy, StrategyError


def _request(compile: str | None) -> PlanRequest:
    return PlanRequest(
        model="gpt2",
        cluster=Cluster.preset("dgx-h100"),
        global_batch=16,
        seq=1024,
        dtype="bf16",
        constraints=Constraints(compile=compile),
    )


def test_the_compile_choices_the_search_prices() -> None:
    def compiles(c: str | None) -> set[str]:
        return {st.compile for st in outer_strategies(_request(c), blocks=12, heads=12)}

    assert compiles("off") == {"off"}  # the default: eager, as before
    assert compiles("block") == {"block"}
    assert compiles(None) == {"off", "block"}


def test_auto_keeps_the_faster_and_the_plan_says_so() -> None:
    profiles = ModelProfiles.of("gpt2", dtype="bf16", seq=1024)
    auto = make_plan(_request(None), profiles).plan
    eager = make_plan(_request("off"), profiles).plan
    assert auto.strategy.compile == "block" and eager.strategy.compile == "off"
    assert auto.predicted["step_time_s"] < eager.predicted["step_time_s"]
    same_but_eager = estimate(
        profiles.at(auto.strategy.micro_batch), _request(None).cluster, replace(auto.strategy, compile="off")
    )
    assert auto.predicted["step_time_s"] < same_but_eager.step_time_s
    assert "each block compiled" in auto.text() and "compiled" not in eager.text()


def test_bad_compile_values_are_one_line_errors() -> None:
    with pytest.raises(AutoparError, match="compile must be one of off, block or None, got 'jit'"):
        Constraints(compile="jit")
    with pytest.raises(StrategyError, match="compile must be one of off, block, got 'yes'"):
        Strategy(compile="yes")
    old = Strategy(dp=2, global_batch=2).to_dict()
    del old["compile"]  # a plan written before the knob
    assert Strategy.from_dict(old).compile == "off"


def test_plan_cli_compile_auto(capsys) -> None:
    code = main(
        ["plan", "gpt2", "--cluster", "dgx-h100", "--global-batch", "16", "--compile", "auto", "--json"]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["plan"]["strategy"]["compile"] == "block"
    with pytest.raises(SystemExit) as e:
        main(["estimate", "gpt2", "--cluster", "dgx-h100", "--compile", "auto"])
    assert e.value.code == 2  # estimate prices one strategy: off or block
