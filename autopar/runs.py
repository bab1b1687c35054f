"""What the runtime can run: which degrees run data parallelism on DDP, which pipeline schedules
run with ZeRO-3 and per-operator recompute, and which uneven data-parallel shares keep every
rank's collectives in step (``Strategy`` checks itself with these; the planner offers only
these)."""

from __future__ import annotations

ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")
"""Schedules that split each backward into its input-gradient (B) and weight-gradient (W) parts
and run the W parts in what would be bubble (Qi et al. 2024, "Zero Bubble Pipeline Parallelism")."""


def runs_on_ddp(*, tp: int, pp: int, dp: int, zero: int, ep: int = 1) -> bool:
    """Whether these degrees run the data-parallel axis on DDP (``Strategy.uses_ddp``)."""
    return dp > 1 and tp == 1 and pp == 1 and ep == 1 and zero <= 1


def runs_with_zero(schedule: str, zero: int) -> bool:
    """Whether ``schedule`` runs under ZeRO stage ``zero`` on a data-parallel pipeline: not a
    zero-bubble schedule with ZeRO-3 (FSDP2 reshards the weights before torch's separate
    weight-gradient pass; gradients measured wrong)."""
    return not (schedule in ZERO_BUBBLE and zero == 3)


def runs_with_policies(schedule: str, pp: int) -> bool:
    """Whether ``schedule`` runs blocks under per-operator recompute policies: not a zero-bubble
    schedule over pp > 1 (it runs backward twice over each block, input gradients then weight
    gradients, and torch's selective activation checkpointing replays its saved outputs once:
    "Trying to backward an extra time", seen in a dry run of Llama 3 405B's plan)."""
    return not (schedule in ZERO_BUBBLE and pp > 1)


def shares_problem(
    shares: tuple[int, ...], *, dp: int, micro_batch: int, global_batch: int, zero: int, cp: int, ep: int
) -> str | None:
    """Why micro-batches per data-parallel replica ``shares`` can't run, or None (empty: every
    replica runs global_batch / (dp·micro_batch)). Replicas that run different numbers of
    micro-batches must still issue the same data-parallel collectives: once per step, as DDP's
    all-reduce and FSDP2's gathers and reductions below ZeRO-2 do (ZeRO-2 and 3 reduce or
    gather per micro-batch, so a replica with more micro-batches would wait on the others
    forever). Loss and gradients stay the global batch's mean: each replica's losses are
    divided by the mean count, Σ shares / dp (``runtime.schedules``)."""
    if not shares:
        return None
    if len(shares) != dp or any(not isinstance(m, int) or m < 1 for m in shares):
        return (
            f"dp_shares {list(shares)}: give {dp} positive micro-batch counts, one per data-parallel replica"
        )
    if sum(shares) * micro_batch != global_batch:
        return (
            f"dp_shares {list(shares)} run {sum(shares)} micro-batches of {micro_batch}, "
            f"{sum(shares) * micro_batch} sequences, but the global batch is {global_batch}"
        )
    if len(set(shares)) > 1 and (zero >= 2 or cp > 1 or ep > 1):
        return (
            f"uneven dp_shares {list(shares)} need ZeRO 0 or 1 and no context or expert parallelism "
            f"(got ZeRO-{zero}, cp {cp}, ep {ep}): those run collectives every micro-batch"
        )
    return None
