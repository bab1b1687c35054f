"""``launch``: children forked from the preloaded server see the caller's environment of the moment
and their errors come back as ``spawn``'s do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessRaisedException

from autopar.measure.launch import launch


def _write_env(rank: int, out: str) -> None:
    with open(f"{out}.{rank}", "w") as f:
        f.write(os.environ.get("AUTOPAR_LAUNCH_PROBE", "unset"))


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails")


def test_children_see_the_environment_of_the_launch(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "env")
    launch(_write_env, args=(out,), nprocs=2)  # starts the server (if no test did) without the variable
    monkeypatch.setenv("AUTOPAR_LAUNCH_PROBE", "set after the server started")
    launch(_write_env, args=(out,), nprocs=2)
    assert [Path(f"{out}.{r}").read_text() for r in range(2)] == ["set after the server started"] * 2


def test_a_childs_exception_is_raised_in_the_caller() -> None:
    with pytest.raises(ProcessRaisedException, match="rank 1 fails"):
        launch(_fail, nprocs=2)
