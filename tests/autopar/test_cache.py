"""The capture cache on disk (``autopar.cache``): JSON entries named by their key and the code's
fingerprint, written atomically, off on request, and a folder that cannot be written leaves
planning uncached; a warm ``autopar plan`` of a built-in model neither captures nor imports
torch, and plans exactly as a cold one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autopar import cache
from autopar.planner import ModelProfiles


@pytest.fixture
def cache_in(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_entries_round_trip_by_key_and_nothing_else_is_left(cache_in) -> None:
    assert cache.load("profile", {"model": "m", "seq": 8}) is None
    assert cache.store("profile", {"model": "m", "seq": 8}, {"x": [1, 2]})
    assert cache.load("profile", {"seq": 8, "model": "m"}) == {"x": [1, 2]}  # key order is not the key
    assert cache.load("profile", {"model": "m", "seq": 16}) is None
    assert cache.load("tp", {"model": "m", "seq": 8}) is None  # another kind
    names = os.listdir(cache_in)
    assert len(names) == 1 and names[0].startswith("profile-") and names[0].endswith(".json")
    (cache_in / names[0]).write_text("{torn")  # a torn entry is a miss, not an error
    assert cache.load("profile", {"model": "m", "seq": 8}) is None


def test_off_and_unwritable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    assert cache.cache_dir() is None and not cache.store("profile", {"k": 1}, {})
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(blocker / "cache"))  # under a file: cannot be made
    assert not cache.store("profile", {"k": 1}, {"v": 1})
    assert cache.load("profile", {"k": 1}) is None
    assert len(cache.code_fingerprint()) == 64


def test_a_profile_round_trips_through_json(cache_in) -> None:
    profile = ModelProfiles.of("gpt2", dtype="bf16", seq=128).at(1)
    again = type(profile).from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile and again.captured is None


PLAN = [
    "plan",
    "gpt2",
    "--cluster",
    "dgx-h100",
    "--global-batch",
    "16",
    "--seq",
    "256",
    "--tp",
    "2",
    "--json",
]
WARM = f"""
import json, sys
from autopar.cli import main
code = main({PLAN!r})
assert code == 0, code
assert "torch" not in sys.modules, "a warm plan imported torch"
"""


@pytest.mark.slow
def test_a_warm_plan_needs_no_capture_and_no_torch(cache_in) -> None:
    env = {**os.environ, cache.CACHE_ENV: str(cache_in)}
    cold = subprocess.run([sys.executable, "-m", "autopar", *PLAN], capture_output=True, text=True, env=env)
    assert cold.returncode == 0, cold.stderr[-2000:]
    kinds = {name.split("-")[0] for name in os.listdir(cache_in)}
    assert kinds >= {"profile", "tp", "tables"}, kinds
    warm = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, env=env)
    assert warm.returncode == 0, warm.stderr[-2000:]
    a, b = json.loads(cold.stdout)["plan"], json.loads(warm.stdout)["plan"]
    assert a["tensor_parallel"] and a["strategy"]["tp"] == 2
    a.pop("solve_time_s"), b.pop("solve_time_s")
    assert a == b  # the same plan, to the last operator's TP strategy


def test_entries_of_other_code_are_misses_and_are_removed(cache_in, monkeypatch) -> None:
    monkeypatch.setattr(cache, "code_fingerprint", lambda: "a" * 64)
    assert cache.store("profile", {"k": 1}, {"v": "old"})
    assert cache.store("tp", {"k": 1}, {"v": "old"})
    monkeypatch.setattr(cache, "code_fingerprint", lambda: "b" * 64)  # the code changed
    assert cache.load("profile", {"k": 1}) is None
    assert cache.store("profile", {"k": 1}, {"v": "new"})
    assert cache.load("profile", {"k": 1}) == {"v": "new"}
    assert all("-bbbbbbbbbbbbbbbb-" in name for name in os.listdir(cache_in))  # the old ones are gone
