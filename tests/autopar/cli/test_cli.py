"""The CLI: inspect/models/clusters output, --json, MODEL forms, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from autopar.cli import main
from autopar.cost_models import closed_forms

FACTORY = textwrap.dedent(
    """
    from autopar.zoo import GPT, GPTConfig

    def tiny():
        return GPT(GPTConfig(n_layer=5, n_embd=64, n_head=4, vocab_size=100, block_size=64))

    def not_a_model():
        return 42
    """
)


def run_json(capsys, *argv: str) -> object:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_json_zoo_gpt(capsys) -> None:
    rep = run_json(capsys, "inspect", "gpt2", "--seq", "256", "--batch", "2")
    assert rep["total_params"] == 124439808
    expected = closed_forms.gpt_model_flops(B=2, s=256, l=12, h=768, V=50257)
    assert rep["total_flops"] == pytest.approx(expected, rel=1e-9)
    assert [t["name"] for t in rep["layer_types"]] == ["embed", "Block", "head"]
    assert rep["layer_types"][1]["count"] == 12
    names = [c["name"] for c in rep["checks"]]
    assert names[:2] == ["parameters", "step FLOPs"]
    assert all(abs(c["rel_error"]) < 0.005 for c in rep["checks"] if c["name"] != "saved bytes / layer")


def test_inspect_table(capsys) -> None:
    assert main(["inspect", "llama3-8b", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert "TransformerBlock" in out and "8.03 B" in out and "one training step" in out


def test_inspect_file_factory_and_module_factory(capsys, tmp_path, monkeypatch) -> None:
    path = tmp_path / "mymodels.py"
    path.write_text(FACTORY)
    rep = run_json(capsys, "inspect", f"{path}:tiny", "--seq", "32")
    assert rep["layer_types"][1]["count"] == 5
    monkeypatch.syspath_prepend(str(tmp_path))
    rep2 = run_json(capsys, "inspect", "mymodels:tiny", "--seq", "32")
    assert rep2["total_params"] == rep["total_params"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "gpt-9000"], "unknown model 'gpt-9000'"),
        (["inspect", "nofile.py:f"], "model file 'nofile.py' does not exist"),
        (["inspect", "no_such_module_xyz:f"], "can't import 'no_such_module_xyz'"),
        (["inspect", "FILE:missing"], "has no attribute 'missing'"),
        (["inspect", "FILE:not_a_model"], "returned int, expected an nn.Module"),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, message, capsys, tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text(FACTORY)
    argv = [a.replace("FILE", str(path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bad_arguments_exit_2_without_traceback() -> None:
    for argv in (["inspect", "gpt2", "--batch", "0"], ["inspect", "nope"], ["frobnicate"]):
        proc = subprocess.run([sys.executable, "-m", "autopar", *argv], capture_output=True, text=True)
        assert proc.returncode == 2, argv
        assert "Traceback" not in proc.stderr


def test_models_lists_zoo_with_counts(capsys) -> None:
    rows = run_json(capsys, "models")
    by_name = {r["name"]: r for r in rows}
    assert by_name["llama3-405b"]["params"] == 405853388800
    assert {"gpt2", "gpt3-175b", "megatron-1t", "llama3-70b", "mixtral-8x7b"} <= set(by_name)


def test_clusters_lists_presets(capsys) -> None:
    rows = run_json(capsys, "clusters")
    assert [r["name"] for r in rows] == [
        "dgx-a100-40g",
        "dgx-a100-80g",
        "dgx-h100",
        "dgx-h200",
        "h100-96g-500w",
        "l40s-100gbe",
        "a100-pcie-25gbe",
        "cpu",
    ]
    assert main(["clusters"]) == 0
    assert "H100-SXM5-80GB" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["plan", "profile"])
def test_an_output_that_cannot_be_written_is_refused_before_the_work(capsys, tmp_path, command) -> None:
    """`--out` into a missing folder or onto a folder: exit 2 with one line, at once (no capture,
    no planning), and nothing written, no temporary file left."""
    args = {
        "plan": ["plan", "gpt3-175b", "--cluster", "dgx-a100-80g", "--global-batch", "8"],
        "profile": ["profile", "gpt2"],
    }[command]
    for out, message in ((tmp_path / "missing" / "p.json", "does not exist"), (tmp_path, "is a directory")):
        assert main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no p.json, no *.tmp


def test_expert_skew_is_a_number_of_at_least_one(capsys) -> None:
    from autopar.plan import _expert_note
    from autopar.strategy import Strategy

    for bad in ("0.5", "x", "inf"):
        with pytest.raises(SystemExit) as exit_:
            main(
                [
                    "estimate",
                    "mixtral-8x7b",
                    "--cluster",
                    "dgx-h100",
                    "--global-batch",
                    "8",
                    "--expert-skew",
                    bad,
                ]
            )
        assert exit_.value.code == 2
        assert "--expert-skew" in capsys.readouterr().err
    st = Strategy(dp=8, ep=4, micro_batch=1, global_batch=8, seq=64, expert_skew=1.25)
    note = _expert_note(st, {"breakdown_s": {"ep_comm": 0.5}})
    assert "ep 4 of the 8" in note and "busiest rank at 1.25× an even share" in note
    assert "busiest" not in _expert_note(Strategy(dp=8, ep=4, micro_batch=1, global_batch=8, seq=64), {})
