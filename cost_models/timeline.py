"""One training step laid out in time, per pipeline rank: the estimate's terms, ordered by the
schedule (what ``autopar report`` draws).

Each rank runs its forwards (F) and backwards (B) of every micro-batch in its schedule's order:

- GPipe: every F, then every B (Huang et al. 2019);
- 1F1B: on rank k of p, min(p − 1 − k, m) warm-up forwards, then one F and one B in turn, then
  the remaining backwards (Narayanan et al. SC'21 §2.2, Fig. 4 top; torch's ``Schedule1F1B``);
- zero-bubble schedules (interleaved-zb, ZBV, DualPipeV): torch's own order
  (``pipeline.torch_orders``), each backward as B (recompute, input gradient, TP) and W (the
  weight gradient) — chunk c on ``Strategy.chunk_rank(c)``, no hop between chunks of one rank;
- interleaved 1F1B with v chunks per rank (chunk c on rank c mod p): min((p − k − 1)·2 +
  (v − 1)·p, m·v) warm-up forwards, then one F and one B in turn; the j-th forward of a rank
  runs local chunk (j ÷ p) mod v on micro-batch (j ÷ pv)·p + j mod p, the j-th backward local
  chunk v − 1 − (j ÷ p) mod v on the same micro-batch (SC'21 Fig. 4 bottom; Megatron-LM's
  ``schedules.py`` and torch's ``ScheduleInterleaved1F1B`` order them so).

An operation starts when its rank is free and its input has arrived: F(i, c) after F(i, c − 1)
plus one pipeline hop, B(i, c) after B(i, c + 1) plus a hop (the last chunk's B after its own
F); the hop is drawn on the receiving rank as a p2p event. Durations are the estimate's
per-micro-batch terms of the rank (a chunk takes 1/v of them): F = forward compute + its TP
collectives, B = recompute + backward compute + its TP collectives.
After its last backward each rank spends its exposed DP/ZeRO communication, then its optimizer
step. Gaps are the bubble. With equal ranks and no hop time the makespan of the pipeline part is
the closed form's (m + (p − 1)/v)·(t_f + t_b) (estimate's doc); with unequal ranks it is
shorter, because the closed form prices every rank at the slowest one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from autopar.cost_models.dp_overlap import dp_exposed_s
from autopar.cost_models.pipeline import torch_orders
from autopar.cost_models.rank_load import RankLoad, optimizer_s, rank_units
from autopar.cost_models.terms import Terms
from autopar.strategy import ZERO_BUBBLE, Strategy, remat


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """One pipeline rank's share of a step, in seconds: per micro-batch (all its chunks
    together), except ``dp_comm_s`` and ``optimizer_s``, which are per step."""

    stage: int
    forward_s: float
    """Forward compute."""
    tp_forward_s: float
    """Tensor-parallel collectives of the forward (half of a layer's, a third under full
    recompute, whose recomputed forward repeats them in the backward)."""
    recompute_s: float
    """Compute redone in the backward."""
    backward_s: float
    """Backward compute."""
    tp_backward_s: float
    """Tensor-parallel collectives of the backward (and of the recomputed forward)."""
    weight_grad_s: float = 0.0
    """The weight-gradient part of ``backward_s`` (``compute.weight_grad_s``), which zero-bubble
    schedules run apart (W)."""
    dp_comm_s: float
    """DP/ZeRO communication the backward does not hide (``dp_overlap.dp_exposed_s``)."""
    optimizer_s: float
    """The optimizer step over the parameters this rank updates."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One segment of the timeline: ``kind`` is forward, tp_comm, recompute, backward, p2p (an
    input arriving from the neighbouring rank), dp_comm or optimizer; ``micro_batch`` and
    ``chunk`` (global chunk index) are -1 for the last two."""

    rank: int
    kind: str
    micro_batch: int
    chunk: int
    start_s: float
    end_s: float


def stage_times(terms: Terms, counts: list[tuple[int, ...]], loads: list[RankLoad]) -> tuple[StageTime, ...]:
    """Each pipeline rank's terms for ``counts`` blocks per rank and recompute choice, whose
    sums ``loads`` (``terms.rank_load``) the estimate already holds."""
    out = []
    for k, (c, load) in enumerate(zip(counts, loads, strict=True)):
        units = rank_units(terms, k, c)
        tp_forward = sum(n * u.tp_s / (3 if remat(r) else 2) for r, u, n in units)
        out.append(
            StageTime(
                stage=k,
                forward_s=load.fwd_s,
                tp_forward_s=tp_forward,
                recompute_s=load.recompute_s,
                backward_s=load.bwd_compute_s,
                tp_backward_s=load.tp_s - tp_forward,
                weight_grad_s=load.wgrad_s,
                dp_comm_s=dp_exposed_s(terms, load),
                optimizer_s=optimizer_s(terms, load),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class _Op:
    kind: str  # "F", "B" (the whole backward), "I" (its input gradient) or "W" (its weight gradient)
    micro_batch: int
    chunk: int  # global chunk index, on rank Strategy.chunk_rank(chunk)


def schedule_orders(st: Strategy) -> list[list[_Op]]:
    """Every pipeline rank's operations in schedule order (zero bubble: torch's own order,
    ``pipeline.torch_orders``, built once for all ranks)."""
    if st.schedule in ZERO_BUBBLE:
        m, v = st.micro_batches, st.virtual_stages
        orders = torch_orders(st.schedule, pp=st.pp, virtual=v, micro_batches=m)
        return [[_Op(kind, i, c) for kind, c, i in order] for order in orders]
    return [schedule_order(st, k) for k in range(st.pp)]


def schedule_order(st: Strategy, rank: int) -> list[_Op]:
    """The operations of pipeline rank ``rank`` in the order its schedule runs them."""
    p, m, v = st.pp, st.micro_batches, st.virtual_stages
    if st.schedule in ZERO_BUBBLE:
        return schedule_orders(st)[rank]
    if st.schedule == "gpipe":
        return [_Op("F", i, rank) for i in range(m)] + [_Op("B", i, rank) for i in range(m)]
    if st.schedule == "1f1b":
        warmup = min(p - 1 - rank, m)
        forwards = [_Op("F", i, rank) for i in range(m)]
        backwards = [_Op("B", i, rank) for i in range(m)]
    else:  # interleaved
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, m * v)
        mb = [(j // (p * v)) * p + j % p for j in range(m * v)]
        forwards = [_Op("F", mb[j], ((j // p) % v) * p + rank) for j in range(m * v)]
        backwards = [_Op("B", mb[j], (v - 1 - (j // p) % v) * p + rank) for j in range(m * v)]
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def simulate(st: Strategy, times: tuple[StageTime, ...], hop_s: float) -> list[Event]:
    """The step's events on every pipeline rank (module doc); ``hop_s``: one activation or
    gradient send between neighbouring ranks."""
    p, v = st.pp, st.virtual_stages
    assert len(times) == p, (len(times), p)
    orders = schedule_orders(st)
    done: dict[tuple[str, int, int], float] = {}
    free, pos, events = [0.0] * p, [0] * p, []
    while any(pos[k] < len(orders[k]) for k in range(p)):
        progressed = False
        for k in range(p):
            while pos[k] < len(orders[k]):
                op = orders[k][pos[k]]
                dep, hop = _dependency(op, last_chunk=p * v - 1, hop_s=hop_s, st=st)
                if dep is not None and dep not in done:
                    break
                start = max(free[k], done[dep] + hop if dep is not None else 0.0)
                if dep is not None and hop > 0:  # the input's send, drawn on the receiving rank
                    e = Event(
                        rank=k,
                        kind="p2p",
                        micro_batch=op.micro_batch,
                        chunk=op.chunk,
                        start_s=done[dep],
                        end_s=done[dep] + hop,
                    )
                    events.append(e)
                free[k] = _run(events, k, op, start, times[k], v)
                done[("B" if op.kind == "I" else op.kind, op.micro_batch, op.chunk)] = free[k]
                pos[k] += 1
                progressed = True
        assert progressed, "the schedule's order deadlocks"
    for k, t in enumerate(times):
        for kind, seconds in (("dp_comm", t.dp_comm_s), ("optimizer", t.optimizer_s)):
            events.append(
                Event(rank=k, kind=kind, micro_batch=-1, chunk=-1, start_s=free[k], end_s=free[k] + seconds)
            )
            free[k] += seconds
    return [e for e in events if e.end_s > e.start_s]


def _dependency(
    op: _Op, *, last_chunk: int, hop_s: float, st: Strategy
) -> tuple[tuple[str, int, int] | None, float]:
    """The operation ``op`` waits for, and the hop between them (0 on the same rank)."""
    if op.kind == "W":
        return ("B", op.micro_batch, op.chunk), 0.0
    if op.kind == "F":
        if op.chunk == 0:
            return None, 0.0
        same = st.chunk_rank(op.chunk - 1) == st.chunk_rank(op.chunk)
        return ("F", op.micro_batch, op.chunk - 1), 0.0 if same else hop_s
    if op.chunk == last_chunk:
        return ("F", op.micro_batch, op.chunk), 0.0
    same = st.chunk_rank(op.chunk + 1) == st.chunk_rank(op.chunk)
    return ("B", op.micro_batch, op.chunk + 1), 0.0 if same else hop_s


def _run(events: list[Event], rank: int, op: _Op, start_s: float, t: StageTime, v: int) -> float:
    """Append ``op``'s segments from ``start_s`` (a chunk's share: 1/v); returns its end. An
    input-gradient backward I leaves the weight gradient to its W."""
    w = t.weight_grad_s if op.kind == "I" else 0.0
    backward = [("recompute", t.recompute_s), ("backward", t.backward_s - w), ("tp_comm", t.tp_backward_s)]
    parts: list[tuple[str, float]] = {
        "F": [("forward", t.forward_s), ("tp_comm", t.tp_forward_s)],
        "W": [("backward", t.weight_grad_s)],
    }.get(op.kind, backward)
    now = start_s
    for kind, seconds in parts:
        end = now + seconds / v
        events.append(
            Event(rank=rank, kind=kind, micro_batch=op.micro_batch, chunk=op.chunk, start_s=now, end_s=end)
        )
        now = end
    return now


def stage_times_from_dicts(rows: list[dict[str, Any]]) -> tuple[StageTime, ...]:
    """Inverse of ``[t.to_dict() for t in times]`` (a plan's ``predicted["stage_times"]``)."""
    return tuple(
        StageTime(stage=int(r["stage"]), **{k: float(v) for k, v in r.items() if k != "stage"}) for r in rows
    )


__all__ = [
    "Event",
    "StageTime",
    "schedule_order",
    "schedule_orders",
    "simulate",
    "stage_times",
    "stage_times_from_dicts",
]
