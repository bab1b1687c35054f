"""Each knob declared once (``autopar.knobs``): a ``Strategy`` field's ``Knob`` makes its checks,
its ``Constraints`` field and its flags of ``plan``, ``verify`` and ``estimate``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, make_dataclass

import pytest

from autopar import Constraints
from autopar.cli import build_parser
from autopar.cli.common import add_knob_flags, knob_values
from autopar.errors import AutoparError, StrategyError
from autopar.knobs import constraint_fields, constraint_problem, field_problem, knob, knobs
from autopar.strategy import Strategy

RESULTS = {"layout", "policies", "dp_shares"}  # what the planner decides about a plan, not a knob


def test_every_strategy_field_is_a_declared_knob() -> None:
    assert {f.name for f in fields(Strategy)} - set(knobs(Strategy)) == RESULTS
    fixable = {n for n, k in knobs(Strategy).items() if k.fixable}
    assert fixable == {f.name for f in fields(Constraints)} - {
        "recompute",  # a set of choices allowed, not Strategy.recompute's one
        "allow_lossy_comm",
        "memory_cap_bytes",
        "max_micro_batch",
        "reserve_bytes",
    }
    assert Constraints().compile == "off" and Constraints().expert_skew == 1.0 and Constraints().tp is None


def _option_names(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices[command]._actions for o in a.option_strings}


@pytest.mark.parametrize("command", ["plan", "verify", "estimate"])
def test_each_command_has_a_flag_per_fixable_knob(command: str) -> None:
    options = _option_names(command)
    fixable = [name for name, k in knobs(Strategy).items() if k.fixable]
    assert fixable and all(f"--{name.replace('_', '-')}" in options for name in fixable), command


def test_one_line_errors_from_the_declarations() -> None:
    with pytest.raises(StrategyError, match=r"^tp must be a positive integer, got 0$"):
        Strategy(tp=0)
    with pytest.raises(StrategyError, match=r"^zero must be one of 0, 1, 2, 3, got 4$"):
        Strategy(zero=4)
    with pytest.raises(StrategyError, match=r"^bucket_mb must be a positive number of MiB, got 0$"):
        Strategy(bucket_mb=0)
    with pytest.raises(AutoparError, match=r"^compile must be one of off, block or None, got 'jit'$"):
        Constraints(compile="jit")
    with pytest.raises(AutoparError, match=r"^expert_skew must be a number ≥ 1, got None$"):
        Constraints(expert_skew=None)
    with pytest.raises(AutoparError, match=r"^micro_batch must be a positive integer or None, got 0$"):
        Constraints(micro_batch=0)


def test_a_new_knob_is_one_field() -> None:
    """A knob declared on a dataclass gets its check, its constraint field and its flags with
    nothing else written (what adding a Strategy field does)."""

    @dataclass(frozen=True, kw_only=True)
    class Toy:
        cp: int = knob(1, kind=int, least=1, help="context-parallel degree")
        ring: str = knob("allgather", kind=str, choices=("allgather", "alltoall"), help="CP rotation")

    assert field_problem(Toy, Toy(cp=2)) == ""
    assert field_problem(Toy, Toy(cp=0)) == "cp must be a positive integer, got 0"
    Fixed = make_dataclass("Fixed", constraint_fields(Toy), frozen=True, kw_only=True)
    assert [f.name for f in fields(Fixed)] == ["cp", "ring"] and Fixed().cp is None
    assert constraint_problem(Toy, Fixed(ring="ring")).startswith(
        "ring must be one of allgather, alltoall or None"
    )
    parser = argparse.ArgumentParser()
    add_knob_flags(parser, fixing=True, cls=Toy)
    assert vars(parser.parse_args(["--cp", "4"])) == {"cp": 4, "ring": None}
    with pytest.raises(SystemExit):
        parser.parse_args(["--ring", "ring"])
    estimate = argparse.ArgumentParser()
    add_knob_flags(estimate, fixing=False, cls=Toy)
    assert vars(estimate.parse_args([])) == {"cp": 1, "ring": "allgather"}


def test_flags_reach_constraints_and_strategy() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["plan", "gpt2", "--cluster", "cpu", "--global-batch", "8", "--tp", "2", "--compile", "auto"]
    )
    values = knob_values(args)
    assert values["tp"] == 2 and values["compile"] is None and values["zero"] is None
    args = parser.parse_args(
        ["estimate", "gpt2", "--cluster", "cpu", "--global-batch", "8", "--bucket-mb", "100"]
    )
    assert knob_values(args)["bucket_mb"] == 100.0 and knob_values(args)["dp"] is None
