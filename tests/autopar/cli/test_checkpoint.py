"""``autopar replan`` and ``autopar export`` refuse what is no checkpoint in one line, exit 2
(the working paths run on a real checkpoint in ``runtime/test_elastic.py``)."""

from __future__ import annotations

from autopar.cli import main


def test_no_checkpoint_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "step-000000003.tmp").mkdir()  # half-written: not a checkpoint
    for argv in (
        ["export", str(tmp_path / "empty"), "--to", "torch", str(tmp_path / "w.pt")],
        ["export", str(tmp_path), "--to", "torch", str(tmp_path / "w.pt")],
        ["replan", "gpt2", "--checkpoint", str(tmp_path / "missing"), "--cluster", "cpu"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is neither a checkpoint folder nor a directory of them" in err
    assert main(["export", str(tmp_path), "--to", "torch", str(tmp_path / "no" / "w.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--to", "torch", "w.pt", "--model", "gpt2"]) == 2
    assert "--model is for --to hf" in capsys.readouterr().err
    assert not (tmp_path / "w.pt").exists()
