"""What every test shares.

- The disk capture cache (``autopar.cache``) is off unless a test turns it on for itself (a
  developer's warm cache must not hide a capture bug); processes the tests start inherit it.
- Tiers: a test that starts processes (a process group, torchrun, the CLI in a subprocess) or runs
  for more than a few seconds is marked ``slow``; every other test is ``quick``. ``python -m pytest
  -m quick`` is the tier to iterate with (unit tests, cost models, planner, capture, two small
  2-process launches), ``python -m pytest`` the whole suite (what CI runs).
- Both cores: a run over whole folders (plain ``python -m pytest``, ``-m quick``) is spread over
  two pytest-xdist workers, a file per worker at a time (``--dist loadfile``: a module's fixtures
  run once); naming files or tests runs them in this process. ``-n 0`` forces one process,
  ``PYTEST_XDIST_AUTO_NUM_WORKERS`` another count.
- Helpers, imported by the test modules (``from tests.conftest import plan_for``; pytest registers
  this module as ``tests.conftest``, and the processes a test starts import it by that name):
  ``profiles_of`` (a model captured once per session), ``plan_for`` (the planner's plan for a tiny
  model on a one-node ``cpu`` cluster with some knobs fixed), ``default_init``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ["AUTOPAR_CACHE"] = "off"

WORKERS = 2
"""pytest-xdist workers for a run over folders: the machines the suite runs on have 2 cores."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): WORKERS when the run names only folders, else 0 (this
    process: a file runs on one worker anyway, and a single test should start at once)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    named = [a.split("::")[0] for a in config.args]
    folders = all(Path(config.rootpath, a).is_dir() for a in named)
    return min(WORKERS, os.cpu_count() or 1) if folders else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that is not ``slow`` as ``quick``; run the files holding slow tests first,
    each file's tests in their order (the long files start early on the two workers, and the
    quick files fill the end)."""
    slow_files = set()
    for item in items:
        if item.get_closest_marker("slow"):
            slow_files.add(item.path)
        else:
            item.add_marker(pytest.mark.quick)
    order = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (item.path not in slow_files, order[item.path]))


def _key(make: Callable[[], Any]) -> Any:
    """What names a model factory: the function, or a partial's function and arguments."""
    if isinstance(make, functools.partial):
        return (make.func, make.args, tuple(sorted(make.keywords.items())))
    return make


_PROFILES: dict[Any, Any] = {}
"""``profiles_of``'s captures, for the whole session (one pytest process or xdist worker)."""


def profiles_of(make: Callable[[], Any], *, dtype: str, seq: int) -> Any:
    """``ModelProfiles`` of the model ``make()`` builds on the meta device, captured once per session
    for each (factory, dtype, seq): a test factory builds the same model every call (it takes no
    arguments and seeds itself), and a capture is the slow part of planning a tiny model."""
    import torch

    from autopar.planner import ModelProfiles

    key = (_key(make), dtype, seq)
    if key not in _PROFILES:
        with (
            torch.random.fork_rng(devices=[]),
            torch.device("meta"),
        ):  # a factory that seeds: the test's RNG untouched
            _PROFILES[key] = ModelProfiles.of(make(), dtype=dtype, seq=seq)
    return _PROFILES[key]


def plan_for(
    make: Callable[[], Any],
    *,
    batch: int,
    seq: int,
    dtype: str = "fp32",
    gpus: int | None = None,
    name: str | None = None,
    **knobs: Any,
) -> Any:
    """The planner's ``Plan`` for the model ``make()`` builds, on a one-node ``cpu`` cluster of ``gpus``
    (default: the world the knobs fix, tp × pp × dp), under ``Constraints(**knobs)`` with micro-batch 2
    and no recompute unless the knobs say otherwise, named ``name`` (default: the model's class, as
    ``autopar.plan`` names it); the model captured once (``profiles_of``)."""
    import torch

    from autopar import Cluster, Constraints, PlanRequest
    from autopar.planner import make_plan

    world = gpus or knobs.get("tp", 1) * knobs.get("pp", 1) * knobs.get("dp", 1)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        meta = make()
    request = PlanRequest(
        model=meta,
        name=name,
        cluster=Cluster.preset("cpu", gpus_per_node=world),
        global_batch=batch,
        seq=seq,
        dtype=dtype,
        constraints=Constraints(**{"micro_batch": 2, "recompute": ("none",), **knobs}),
    )
    return make_plan(request, profiles_of(make, dtype=dtype, seq=seq)).plan


def default_init(model: Any) -> Any:
    """PyTorch's own initialisation of every layer (``reset_parameters``, not a model's 0.02
    scaling), in place; returns the model."""
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return model
