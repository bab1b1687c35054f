"""Sums of a rank's unit terms: its load per micro-batch and its peak memory by cause."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models import memory as mem
from autopar.cost_models.terms import Terms, Unit
from autopar.strategy import Strategy, remat


@dataclass(frozen=True, kw_only=True)
class RankLoad:
    """Sums of unit terms over the layers one rank holds."""

    fwd_s: float
    bwd_compute_s: float
    recompute_s: float
    tp_s: float
    bwd_s: float
    wgrad_s: float
    params: float
    zero_units: int
    """FSDP2 units the rank gathers and reduce-scatters at ZeRO 2–3, a collective each: its blocks
    and the root of each pipeline chunk holding the embedding or the head (one root when a single
    chunk holds both: ``runtime.sharding.shard_over_dp``)."""
    act_bytes: float
    deferred_bytes: float
    """Σ ``Unit.deferred_bytes``: weight-op gradients a zero-bubble schedule keeps from I to W."""
    rematerialises: bool
    """A block of the rank is checkpointed whole (full or a per-operator policy): its backward
    rebuilds one block's activations at a time."""
    ep_s: float = 0.0
    """The expert-parallel all-to-alls, part of ``tp_s``."""
    expert_params: float = 0.0
    """Local routed-expert parameters under expert parallelism, part of ``params``."""

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_compute_s

    @property
    def time_s(self) -> float:
        return self.compute_s + self.recompute_s + self.tp_s


def rank_units(terms: Terms, rank: int, counts: tuple[int, ...]) -> list[tuple[str, Unit, int]]:
    """(recompute, unit, count) on pipeline rank ``rank``: ``counts`` blocks per recompute
    choice (``Strategy.choices``), the embedding on the first rank and the head on the last."""
    units = [(r, terms.block[r], n) for r, n in zip(terms.strategy.choices, counts, strict=True)]
    last = terms.strategy.head_rank
    return units + [("none", terms.embed, 1)] * (rank == 0) + [("none", terms.head, 1)] * (rank == last)


def edge_units(st: Strategy, rank: int) -> int:
    """FSDP2 root units of pipeline rank ``rank`` that hold parameters: one per chunk with the
    embedding or the head, the two sharing the only chunk when there is no pipeline."""
    n = int(rank == 0) + int(rank == st.head_rank)
    return min(n, 1) if st.pp == 1 else n


def rank_load(terms: Terms, rank: int, counts: tuple[int, ...]) -> RankLoad:
    """Sum the units of ``counts`` blocks (per ``Strategy.choices``) plus embed/head where they live."""
    units = [(u, n) for _, u, n in rank_units(terms, rank, counts)]
    return RankLoad(
        fwd_s=sum(u.fwd_s * n for u, n in units),
        bwd_compute_s=sum(u.bwd_compute_s * n for u, n in units),
        recompute_s=sum(u.recompute_s * n for u, n in units),
        tp_s=sum(u.tp_s * n for u, n in units),
        bwd_s=sum(u.bwd_s * n for u, n in units),
        wgrad_s=sum(u.wgrad_s * n for u, n in units),
        params=sum(u.params * n for u, n in units),
        zero_units=sum(counts) + edge_units(terms.strategy, rank),
        act_bytes=sum(u.act_bytes * n for u, n in units),
        deferred_bytes=sum(u.deferred_bytes * n for u, n in units),
        rematerialises=any(n for r, n in zip(terms.strategy.choices, counts, strict=True) if remat(r)),
        ep_s=sum(u.ep_s * n for u, n in units),
        expert_params=sum(u.expert_params * n for u, n in units),
    )


def optimizer_s(terms: Terms, load: RankLoad) -> float:
    """The optimizer step of a rank holding ``load`` (local expert parameters weighed as
    ``Terms.weighted`` says: a ZeRO rank updates 1/(dp/ep) of its experts)."""
    return terms.weighted(load.params, load.expert_params, "optimizer") * terms.opt_s_per_param


def rank_memory_terms(terms: Terms, rank: int, load: RankLoad) -> dict[str, float]:
    """Peak memory of a rank by cause (bytes)."""
    acts = terms.held_bytes(rank, load.act_bytes, load.deferred_bytes)
    if load.rematerialises:
        acts += terms.block["none"].act_full_bytes
    st = terms.strategy
    states = mem.rank_state_bytes(load.params - load.expert_params, st)
    if load.expert_params:  # ZeRO shards them over the dp / ep ranks holding the same experts
        experts = mem.rank_state_bytes(load.expert_params, st, shard=st.dp_shard // st.ep)
        states = {k: v + experts[k] for k, v in states.items()}
    return {
        **states,
        "activations": acts,
        "loss": terms.loss_bytes if rank == terms.strategy.head_rank else 0.0,
        "comm_buffers": terms.buffers[rank],
        "reserve": terms.reserve_bytes,
    }
