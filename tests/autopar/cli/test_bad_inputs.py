"""Bad inputs, tried as a hostile new user would: every one is exit status 2 (or one
``AutoparError`` in Python) with one line that says what was wrong, no traceback, nothing
half-written, quickly."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

import autopar
from autopar.cli import main
from autopar.errors import AutoparError

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn
    from autopar.zoo import GPT, GPTConfig

    def tiny():
        return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32))

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10)
        def forward(self, x):
            h = self.emb(x)
            if h.sum() > 0:
                h = h * 2
            return self.head(h)

    def branchy():
        return Branchy()

    def empty():
        return nn.Sequential()

    def needs_args(n):
        return nn.Linear(n, n)

    def raises():
        raise RuntimeError("boom in my factory")

    def number():
        return 42
    """
)

PLAN = ["plan", "gpt2", "--cluster", "dgx-h100", "--global-batch", "8", "--seq", "128"]
ESTIMATE = ["estimate", "gpt2", "--cluster", "dgx-h100", "--global-batch", "8", "--seq", "128"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "models.py").write_text(MODELS)
    (d / "syntax.py").write_text("def broken(:\n    pass\n")
    (d / "bad.yaml").write_text("preset: [dgx\n")
    (d / "field.yaml").write_text("preset: dgx-h100\ndevice:\n  memory_bytes: -1\n")
    (d / "cluster.cfg").write_text("preset: cpu\ngpus_per_node: 2\n")
    (d / "truncated.json").write_text('{"model": "gpt2", "strat')
    (d / "string.json").write_text('"e"')
    (d / "folder").mkdir()
    return d


def cases(d) -> list[tuple[list[str], str]]:
    """(argv, a phrase the one line must hold)."""
    m = f"{d}/models.py"
    return [
        (["inspect", "nope"], "unknown model 'nope'"),
        (["inspect", "gpt-2"], "did you mean 'gpt2'"),
        (["inspect", f"{d}/missing.py:f"], "does not exist"),
        (["inspect", f"{m}:nofunc"], "has no attribute 'nofunc'"),
        (["inspect", f"{m}:needs_args"], "needs arguments"),
        (["inspect", f"{m}:raises"], "raised RuntimeError: boom in my factory (models.py, line"),
        (["inspect", f"{d}/syntax.py:broken"], "SyntaxError: invalid syntax (line 1)"),
        (["inspect", f"{m}:empty"], "has no parameters"),
        (["inspect", f"{m}:branchy", "--seq", "8"], "branches on the value of a tensor"),
        (["inspect", f"{m}:number"], "returned int, expected an nn.Module"),
        (["inspect", "nosuchpackage.mod:f"], "can't import 'nosuchpackage.mod'"),
        (["inspect", "gpt2", "--batch", "0"], "expected a positive integer"),
        (["inspect", "gpt2", "--seq", "-5"], "expected a positive integer"),
        (["inspect", "gpt2", "--dtype", "fp8"], "invalid choice"),
        (["inspect", "gpt2", "--seq", "4096"], "exceeds the 1024 positions"),
        (
            ["plan", "autopar.zoo.hf:gpt2", "--cluster", "cpu", "--global-batch", "8", "--seq", "64"],
            "32 positions",
        ),
        (["plan", "gpt2", "--cluster", "nope", "--global-batch", "8"], "nope"),
        (["plan", "gpt2", "--cluster", f"{d}/folder", "--global-batch", "8"], "is a directory"),
        (["plan", "gpt2", "--cluster", f"{d}/bad.yaml", "--global-batch", "8"], "not valid YAML at line 2"),
        (["plan", "gpt2", "--cluster", f"{d}/field.yaml", "--global-batch", "8"], "memory_bytes"),
        (["plan", "gpt2", "--cluster", f"{d}/missing.yaml", "--global-batch", "8"], "does not exist"),
        ([*PLAN, "--memory-cap-gib", "0"], "positive finite number"),
        ([*PLAN, "--memory-cap-gib", "nan"], "positive finite number"),
        ([*PLAN, "--time-limit", "-1"], "positive finite number"),
        ([*PLAN, "--tp", "3"], "multiply to 3, which does not divide 8 GPUs"),
        ([*PLAN, "--tp", "8"], "tp=8 does not divide 12 heads"),
        ([*PLAN, "--nodes", "2", "--pp", "16"], "exceeds the model's 12 layers"),
        ([*PLAN, "--recompute", "x"], "--recompute takes a comma-separated subset"),
        ([*PLAN, "--micro-batch", "3"], "no strategy fits the constraints --micro-batch 3"),
        ([*PLAN, "--out", f"{d}/missing/p.json"], "does not exist"),
        ([*PLAN, "--out", f"{d}/folder"], "is a directory"),
        (["plan", "gpt2", "--cluster", "dgx-h100", "--global-batch", "0"], "expected a positive integer"),
        (["plan", "gpt3-175b", "--cluster", "dgx-a100-40g", "--global-batch", "8"], "no plan fits in"),
        ([*ESTIMATE, "--reserve-gib", "-100"], "non-negative finite number"),
        ([*ESTIMATE, "--tp", "3"], "does not divide the cluster's 8 GPUs"),
        ([*ESTIMATE, "--virtual-stages", "2"], "need a schedule of several chunks per rank"),
        ([*ESTIMATE, "--dp", "3", "--global-batch", "9"], "tp·pp·dp = 1·1·3 = 3 but the cluster has 8 GPUs"),
        (["verify", f"{m}:tiny", "--plan", f"{d}/missing.json"], "can't read plan"),
        (["verify", f"{m}:tiny", "--plan", f"{d}/truncated.json"], "invalid JSON"),
        (["verify", f"{m}:tiny", "--plan", f"{d}/string.json"], "expected a JSON object"),
        (["verify", f"{m}:tiny", "--nproc", "3", "--global-batch", "2"], "global batch of 2 must split"),
        (["verify", f"{m}:tiny", "--switch-at", "2"], "--switch-at K and --switch-to PLAN go together"),
        (["verify", f"{m}:tiny", "--switch-at", "2", "--switch-to", f"{d}/missing.json"], "can't read plan"),
        (["verify", f"{m}:tiny", "--loss", f"{m}:nofunc"], "has no attribute 'nofunc'"),
        (["verify", f"{m}:tiny", "--seq", "64"], "exceeds the 32 positions"),
        (["calibrate", "gpt2", "--plan", "p.json"], "runs under torchrun"),
        (["profile-comm", "--out", "x.json"], "runs under torchrun"),
        (["profile", "gpt2", "--tp-widths", "2", "--out", f"{d}/p.json"], "must include 1"),
        (["profile", "gpt2", "--batch", "0,1", "--out", f"{d}/p.json"], "comma-separated positive integers"),
        (["frobnicate"], "invalid choice"),
    ]


def test_every_bad_input_is_one_line_and_exit_2(files, capsys) -> None:
    before = sorted(p.name for p in files.iterdir())
    for argv, phrase in cases(files):
        start = time.perf_counter()
        code = _exit_code(argv)
        err = capsys.readouterr().err.strip()
        took = time.perf_counter() - start
        assert code == 2, (argv, code, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)
        assert phrase in err, (argv, err)
        assert took < 10, (argv, took)
    assert sorted(p.name for p in files.iterdir()) == before  # nothing written, no *.tmp


def _exit_code(argv: list[str]) -> int:
    """``main``'s status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


def test_a_plan_for_another_model_is_refused_before_any_process_starts(files, capsys, tmp_path) -> None:
    plan = tmp_path / "plan.json"
    assert (
        main(["plan", "gpt2", "--cluster", "cpu", "--global-batch", "8", "--seq", "32", "--out", str(plan)])
        == 0
    )
    capsys.readouterr()
    start = time.perf_counter()
    assert main(["verify", f"{files}/models.py:tiny", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert "the plan names layers this model lacks" in err and len(err.splitlines()) == 1, err
    assert time.perf_counter() - start < 10


def test_the_python_api_raises_one_autopar_error(files) -> None:
    cluster = autopar.Cluster.preset("cpu")
    bad = [
        lambda: autopar.Plan.from_json("{"),
        lambda: autopar.Plan.from_json('"e"'),
        lambda: autopar.Plan.from_dict({**_plan_dict(), "stages": 5}),
        lambda: autopar.PlanRequest(model="gpt2", cluster=cluster, global_batch=0, seq=32),
        lambda: autopar.PlanRequest(model="gpt2", cluster=cluster, global_batch=8, seq=32, time_limit_s=-1),
        lambda: autopar.Constraints(schedule="round-robin"),
        lambda: autopar.Constraints(memory_cap_bytes=0),
        lambda: autopar.Constraints(recompute=()),
        lambda: autopar.plan("gpt2", cluster, global_batch=0, seq_len=32),
        lambda: autopar.Cluster.preset("nope"),
        lambda: autopar.Cluster.from_dict({"preset": "cpu", "gpus_per_node": -2}),
    ]
    for make in bad:
        with pytest.raises(AutoparError) as e:
            make()
        assert len(str(e.value).splitlines()) == 1, str(e.value)


def _plan_dict() -> dict:
    cluster = autopar.Cluster.preset("cpu")
    return json.loads(autopar.plan("gpt2", cluster, global_batch=2, seq_len=32).to_json())
