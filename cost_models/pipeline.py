"""The pipeline bubble of each schedule, in micro-batch times of a rank.

A rank runs each micro-batch as a forward F, an input-gradient backward B and a
weight-gradient backward W (t = F + B + W; schedules that do not split the backward run B + W
as one). With p ranks, v chunks per rank and m micro-batches, the step's pipeline part takes
m·t + bubble on the slowest rank:

- GPipe and 1F1B: (p − 1)·t (Huang et al. 2019; Narayanan et al. SC'21 §2.2);
- interleaved 1F1B: (p − 1)·t / v (Narayanan et al. SC'21 §2.2.2);
- interleaved zero bubble (torch's ``ScheduleInterleavedZeroBubble``, ZB1P; v = 1 is ZB-H1):
  (p − 1)·max(F + B − W, F, B) / v (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3:
  the W passes fill the cool-down, so each of the p − 1 hops costs F + B − W instead of
  F + B + W; a W longer than F or B cannot hide in the gap it fills, whence the max, found on
  torch's orders for every F, B, W in {0.3 … 3}³);
- ZBV and DualPipeV (two chunks per rank in a V): no closed form holds once F, B and W differ
  (torch's ZBV is zero-bubble only when they are equal, its docstring says), so the bubble is
  the makespan of torch's own per-rank action lists for 2p micro-batches, run with chunk times
  F/2, B/2, W/2 minus 2p·t. It does not change with m ≥ 2p (checked in the tests for every
  m up to 5p), so the same number serves any step.

Every closed form equals the makespan of torch's action lists less m·t on equal ranks; the
tests check that against the orders torch's schedule classes build.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from autopar import cache
from autopar.strategy import V_SHAPE, Strategy


def bubble_rounds(st: Strategy, *, fwd_s: float, bwd_input_s: float, wgrad_s: float) -> float:
    """The step's bubble in micro-batch times t = F + B + W of a rank (module doc)."""
    p, v = st.pp, st.virtual_stages
    t = fwd_s + bwd_input_s + wgrad_s
    if p == 1 or t <= 0:
        return 0.0
    if st.schedule in ("gpipe", "1f1b", "interleaved"):
        return (p - 1) / v
    if st.schedule == "interleaved-zb":
        return (p - 1) * max(fwd_s + bwd_input_s - wgrad_s, fwd_s, bwd_input_s) / (v * t)
    assert st.schedule in V_SHAPE, st.schedule
    return _v_bubble_rounds(st.schedule, p, fwd_s, bwd_input_s, wgrad_s)


@lru_cache(maxsize=4096)
def _v_bubble_rounds(schedule: str, pp: int, fwd_s: float, bwd_input_s: float, wgrad_s: float) -> float:
    """``bubble_rounds`` of a V schedule: torch's order for 2·pp micro-batches simulated, once
    per process for each (depth, F, B, W) (the planner's outer choices that differ only in ZeRO
    or data parallelism share a block's times)."""
    t = fwd_s + bwd_input_s + wgrad_s
    chunk = {"fwd_s": fwd_s / 2, "bwd_input_s": bwd_input_s / 2, "wgrad_s": wgrad_s / 2}
    makespan = simulate_orders(_v_orders(schedule, pp), **chunk, chunks=2 * pp)[0]
    return max(0.0, makespan - 2 * pp * t) / t


Action = tuple[str, int, int]
"""(kind F, B, I or W; global chunk; micro-batch): one computation of a rank's schedule (B is
a whole backward, I its input-gradient part)."""


@lru_cache(maxsize=64)
def _v_orders(schedule: str, pp: int) -> tuple[tuple[Action, ...], ...]:
    """``torch_orders`` of a V schedule for 2·pp micro-batches, built once per process (the
    planner prices hundreds of outer choices with the same depth) and kept in the disk cache
    (``autopar.cache``: building them imports torch's pipelining, seconds a warm plan saves)."""
    key = {"schedule": schedule, "pp": pp}
    hit = cache.load("orders", key)
    if hit is not None:
        return tuple(tuple((str(k), int(c), int(i)) for k, c, i in rank) for rank in hit)
    orders = tuple(map(tuple, torch_orders(schedule, pp=pp, virtual=2, micro_batches=2 * pp)))
    cache.store("orders", key, [[list(a) for a in rank] for rank in orders])
    return orders


def torch_orders(schedule: str, *, pp: int, virtual: int, micro_batches: int) -> list[list[Action]]:
    """Each rank's computations in the order ``torch.distributed.pipelining``'s schedule class
    runs them: the class's own ``_calculate_single_rank_operations`` (and, for the interleaved
    zero-bubble schedule, its ``_add_bubbles_to_actions``), computed without stages or a process
    group; overlapped F&B pairs (DualPipeV) run as their parts in order."""
    from torch.distributed.pipelining import schedules as torch_schedules

    names = {
        "interleaved": "ScheduleInterleaved1F1B",
        "interleaved-zb": "ScheduleInterleavedZeroBubble",
        "zbv": "ScheduleZBVZeroBubble",
        "dualpipev": "ScheduleDualPipeV",
    }
    cls = getattr(torch_schedules, names[schedule])
    sched = cls.__new__(cls)  # the order needs only these attributes (torch 2.13's __init__ sets them)
    rounds = max(1, micro_batches // pp)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, virtual, micro_batches
    sched.number_of_rounds, sched.microbatches_per_round = rounds, micro_batches // rounds
    sched.num_stages = sched._num_stages = pp * virtual
    orders = {}
    for rank in range(pp):
        sched.rank = rank
        orders[rank] = sched._calculate_single_rank_operations(rank)
    if schedule == "interleaved-zb":
        sched.pipeline_order = orders
        orders = sched._add_bubbles_to_actions(pp * virtual)
    kind = torch_schedules._ComputationType
    kinds = {kind.FORWARD: "F", kind.BACKWARD_INPUT: "I", kind.BACKWARD_WEIGHT: "W", kind.FULL_BACKWARD: "B"}
    out: list[list[Action]] = []
    for rank in range(pp):
        flat: list[Action] = []
        for action in orders[rank]:
            parts = [] if action is None else (action.sub_actions or (action,))
            flat += [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in parts]
        out.append(flat)
    return out


def simulate_orders(
    orders: Sequence[Sequence[Action]],
    *,
    fwd_s: float,
    bwd_input_s: float,
    wgrad_s: float,
    chunks: int,
    deferred_ratio: float = 0.0,
) -> tuple[float, list[float]]:
    """(makespan, peak chunk activations held per rank) of running ``orders`` with one chunk's
    times, sends instant: F(c) waits for F(c − 1), a backward of c for the backward of c + 1 (the
    last chunk's for its own F), W for its I. A chunk's activations are held from its F to its
    W (or whole backward); with ``deferred_ratio`` r a chunk past its I but not its W weighs
    1 + r (its deferred weight-op gradients, ``memory.deferred_grad_bytes``), but the first
    chunk, whose I computes nothing."""
    duration = {"F": fwd_s, "I": bwd_input_s, "B": bwd_input_s + wgrad_s, "W": wgrad_s}
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * len(orders), [0] * len(orders)
    held, deferred, peak = [0] * len(orders), [0] * len(orders), [0.0] * len(orders)
    while any(pos[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, c, i = order[pos[r]]
                dep = _dependency(kind, c, i, chunks)
                if dep is not None and dep not in done:
                    break
                free[r] = max(free[r], done[dep] if dep is not None else 0.0) + duration[kind]
                done[("B" if kind == "I" else kind, c, i)] = free[r]
                held[r] += (kind == "F") - (kind in ("W", "B"))
                deferred[r] += ((kind == "I") - (kind == "W")) * (c > 0)
                peak[r] = max(peak[r], held[r] + deferred_ratio * deferred[r])
                pos[r] += 1
                progressed = True
        assert progressed, "the schedule's order deadlocks"
    return max(free), peak


def _dependency(kind: str, chunk: int, micro_batch: int, chunks: int) -> tuple[str, int, int] | None:
    """What a computation waits for (``simulate_orders``)."""
    if kind == "F":
        return ("F", chunk - 1, micro_batch) if chunk > 0 else None
    if kind == "W":
        return ("B", chunk, micro_batch)
    return ("F", chunk, micro_batch) if chunk == chunks - 1 else ("B", chunk + 1, micro_batch)


__all__ = ["Action", "bubble_rounds", "simulate_orders", "torch_orders"]
