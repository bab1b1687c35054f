"""How a pipeline's blocks split over its ranks and chunks: the fewest each rank may hold, and
the most even split (``Strategy.blocks_per_rank``, the layout ILP's starting point)."""

from __future__ import annotations

V_SHAPE = ("zbv", "dualpipev")
"""Schedules with two chunks per rank placed in a V: rank k holds chunks k and 2p − 1 − k, so the
first rank runs both the embedding's chunk and the head's (Qi et al. 2024 §6; DeepSeek-V3's DualPipeV)."""


def least_rank_blocks(rank: int, *, pp: int, virtual_stages: int, schedule: str) -> int:
    """``Strategy.min_rank_blocks`` of a pipeline not yet built: a block per chunk but the
    embedding's and the head's (the head on rank 0 in a V, on rank p − 1 looped), at least 1."""
    if virtual_stages == 1:
        return 1
    head_rank = 0 if schedule in V_SHAPE else pp - 1
    return max(1, virtual_stages - (rank == 0) - (rank == head_rank))


def fewest_blocks(*, pp: int, virtual_stages: int, schedule: str) -> int:
    """Fewest blocks a pipeline holds (Σ of ``least_rank_blocks``): p without interleaving,
    p·v − 2 looped, 2p − 1 in a V (its rank 0 runs the embedding's and the head's chunks, and
    one block still)."""
    return sum(
        least_rank_blocks(k, pp=pp, virtual_stages=virtual_stages, schedule=schedule) for k in range(pp)
    )


def even_split(blocks: int, chunks: int, least: list[int] | None = None) -> list[int]:
    """Blocks per chunk, as even as possible; the extras go to the middle chunks (the first
    holds the embedding and the most in-flight activations, the last the head). ``least``: the
    fewest each chunk may hold (Σ ≤ blocks); where the even split leaves a chunk short, it takes
    the blocks from the fullest chunks that can spare them."""
    base, extra = divmod(blocks, chunks)
    middle = sorted(range(chunks), key=lambda c: abs(c - (chunks - 1) / 2))[:extra]
    split = [base + (1 if c in middle else 0) for c in range(chunks)]
    if least is None or sum(least) > blocks or all(n >= lo for n, lo in zip(split, least, strict=True)):
        return split  # (more needed than there are: no split is valid, ``check_strategy`` says so)
    split = [max(n, lo) for n, lo in zip(split, least, strict=True)]
    for _ in range(sum(split) - blocks):  # one at a time from the fullest that can spare one
        spare = max((c for c in range(chunks) if split[c] > least[c]), key=lambda c: split[c])
        split[spare] -= 1
    return split


__all__ = ["even_split", "fewest_blocks", "least_rank_blocks"]
