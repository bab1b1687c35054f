"""Per-expert row counts of a training step (``passes.expert_load``, ``runtime.expert_load``):
equal to the router's own choices counted in one process, under EP2 and under PP2 with every
block recomputed (a recompute counts nothing twice), and a warning naming the experts that
dropped rows over their capacity."""

from __future__ import annotations

import functools
import json
import math
import pathlib
import warnings

import pytest
import torch

from autopar.graph import capture
from autopar.passes.expert_load import count_expert_load
from autopar.runtime.expert_load import ExpertLoad, overflow_warning, unpack_loads
from tests.autopar.runtime.test_expert_parallel import zoo_mixtral
from tests.conftest import plan_for

BATCH, SEQ, E, K = 4, 16, 4, 2


def reference_loads(make, data: torch.Tensor, micro_batch: int, capacity_factor: float | None) -> dict:
    """The router's choices counted on the model as written, micro-batch by micro-batch: per
    expert the rows routed, and those kept under a capacity C = ceil(k·S/E · factor)."""
    model = make()
    seen: dict[str, list[torch.Tensor]] = {}
    for name, moe in model.named_modules():
        if hasattr(moe, "gate") and hasattr(moe, "experts"):
            path = f"{name}.experts"
            hook = functools.partial(lambda p, _m, _i, out: seen[p].append(out.topk(K, dim=-1).indices), path)
            seen[path] = []
            moe.gate.register_forward_hook(hook)
    with torch.no_grad():
        for rows in data.split(micro_batch):
            model(rows)
    loads = {}
    for path, chosen in seen.items():
        routed = [torch.bincount(c.reshape(-1), minlength=E) for c in chosen]
        cap = math.ceil(K * micro_batch * SEQ / E * capacity_factor) if capacity_factor else None
        kept = [r.clamp(max=cap) if cap else r for r in routed]
        loads[path] = ([int(x) for x in sum(routed)], [int(x) for x in sum(kept)])
    return loads


def test_counts_in_one_process_skip_a_recompute_in_backward() -> None:
    """The pass on a capture at world 1: a forward counts each layer's routing once, and a
    backward that recomputes the block (activation checkpointing) adds nothing."""
    make = functools.partial(zoo_mixtral, 0.5)
    data = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    gm, counted = count_expert_load(capture(make(), batch=2, seq=SEQ).gm)
    assert [c.path for c in counted] == ["layers.0.feed_forward.experts", "layers.1.feed_forward.experts"]
    out = torch.utils.checkpoint.checkpoint(gm, data, use_reentrant=False)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    want = reference_loads(make, data, 2, 0.5)
    for c in counted:
        routed, kept = gm.get_submodule(c.counter).rows.tolist()
        assert [routed, kept] == list(want[c.path]), c.path
        assert sum(routed) == 2 * SEQ * K and any(r > k for r, k in zip(routed, kept, strict=True))


def test_unpacking_divides_the_ranks_that_saw_each_token_and_warns_on_drops() -> None:
    from autopar.passes.expert_load import CountedLayer

    layer = CountedLayer(path="l.experts", counter="c", experts=2, top_k=1)
    twice = torch.tensor([6.0, 2.0, 4.0, 2.0])  # two TP ranks saw the same 4 tokens
    (load,) = unpack_loads(twice, [layer], tokens=4).values()
    assert load == ExpertLoad(routed=(3, 1), kept=(2, 1)) and load.dropped == (1, 0)
    assert load.imbalance == 1.5
    text = overflow_warning({"l.experts": load})
    assert text is not None and "1 of 4 routed rows" in text and "experts 0 (1 of 3)" in text
    assert overflow_warning({"l.experts": ExpertLoad(routed=(2, 2), kept=(2, 2))}) is None
    assert unpack_loads(torch.tensor([3.0, 0.0, 3.0, 0.0]), [layer], tokens=4) == {}  # no wrong figure
    from autopar.monitor.metrics import expert_figures

    assert expert_figures({"l.experts": load}) == {"expert_imbalance": 1.5, "expert_dropped_frac": 0.25}
    assert expert_figures({}) == {}


def _plan(make, **knobs):
    return plan_for(make, batch=BATCH, seq=SEQ, name="zoo", gpus=2, micro_batch=1, **knobs)


def _worker(rank: int, init: str, plans: list[str], data: torch.Tensor, out: str) -> None:
    """Two steps of each plan; per step every rank's ``last_expert_load`` and capacity warnings,
    and rank 0 saves the weights the second step routes with."""
    import datetime

    import torch.distributed as dist

    import autopar
    from autopar.plan import Plan

    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timeout)
    torch.set_num_threads(1)
    try:
        results = []
        for i, text in enumerate(plans):
            plan = Plan.from_json(text)
            pm = autopar.parallelize(zoo_mixtral(0.5), plan)
            local = BATCH // plan.strategy.dp
            for step in range(2):
                if step == 1:
                    weights = pm.full_state_dict()
                    if rank == 0:
                        torch.save(weights, f"{out}.{i}.pt")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    pm.train_step(data[step, pm.dp_rank * local : (pm.dp_rank + 1) * local])
                loads = {p: [list(v.routed), list(v.kept)] for p, v in pm.last_expert_load.items()}
                said = [str(w.message) for w in caught if "capacity" in str(w.message)]
                results.append({"loads": loads, "warnings": said})
        pathlib.Path(f"{out}.{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ep2_and_pp2_recomputed_count_what_one_process_routes(tmp_path) -> None:
    """Both steps of EP2 and the second of PP2 (a pipeline's first has no counts: torch runs an
    extra forward to infer shapes), against the routing of the weights each step ran with."""
    from autopar.measure.launch import launch

    make = functools.partial(zoo_mixtral, 0.5)
    plans = [
        _plan(make, tp=1, pp=1, dp=2, ep=2, zero=1, recompute=("none",)),
        _plan(make, tp=1, pp=2, dp=1, ep=1, zero=0, recompute=("full",)),
    ]
    assert (plans[0].strategy.ep, plans[1].strategy.pp) == (2, 2)
    assert set(plans[1].recompute.values()) == {"full"}
    data = torch.randint(0, 64, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    out = str(tmp_path / "loads")
    args = (f"file://{tmp_path}/init", [p.to_json() for p in plans], data, out)
    launch(_worker, args=args, nprocs=2, join=True)
    ranks = [json.loads(pathlib.Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    for i in range(len(plans)):
        trained = functools.partial(_loaded, make, torch.load(f"{out}.{i}.pt"))
        for step, model in enumerate((make, trained)):
            mine, theirs = ranks[0][2 * i + step], ranks[1][2 * i + step]
            assert mine["loads"] == theirs["loads"]  # every rank has them
            if step == 0 and i == 1:
                assert mine["loads"] == {} and not mine["warnings"]
                continue
            want = reference_loads(model, data[step], 1, 0.5)
            assert {p: tuple(v) for p, v in mine["loads"].items()} == want, (i, step)
            (text,) = mine["warnings"]  # rank 0 warns, once a step
            assert "dropped over expert capacity" in text and "layers.0.feed_forward.experts" in text
            assert not theirs["warnings"]


def _loaded(make, state: dict):
    model = make()
    model.load_state_dict(state)
    return model
