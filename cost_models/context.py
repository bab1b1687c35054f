"""Context parallelism's price: what splitting each sequence over cp ranks adds to a block.

A cp rank runs s / cp positions of each of a micro-batch's b sequences, two chunks of s / (2·cp)
placed head and tail so that its share of causal attention is exactly 1/cp
(``passes.context_parallel``). Its compute and its kept activations are therefore those of b / cp
whole sequences: tokens b·s/cp for every token-wise operator, (b/cp)·s² for attention — the
profile at micro-batch b / cp (``cost_models.micro_batch``, affine in the micro-batch), which the
planner prices (``Strategy.rank_sequences``). What that profile lacks is priced here:

- Keys and values all-gathered before attention, per block and micro-batch, as they are before a
  grouped-query repeat (``graph.attention.unrepeated``): (b, kv_heads/t, s, head_dim) each, so
  2·b·s·w/t elements with w = kv_heads·head_dim (``ModelProfile.kv_width``; Llama 3 405B: 1,024
  of its 16,384 channels). The gather is on the critical path (attention waits for it; Llama 3
  left it exposed too, Dubey et al. 2024 §3.3.2), and its backward reduce-scatters their
  gradients, as many bytes. Full recompute gathers again.
- Memory: attention keeps the whole sequence's keys and values, repeated to the query heads,
  instead of the local ones: 2·b·s·h/t·(1 − 1/cp) more elements per block kept (none), or
  rebuilt one block at a time (selective and full recompute rebuild the attention).
"""

from __future__ import annotations

from autopar.cluster import Cluster
from autopar.cost_models import comm
from autopar.cost_models.profile import ModelProfile
from autopar.strategy import Strategy


def kv_gathered_bytes(profile: ModelProfile, st: Strategy) -> float:
    """Bytes of keys and values one rank gathers per block per micro-batch: 2·b·s·w/t·act bytes,
    w the key/value heads × head dim before a grouped-query repeat (``ModelProfile.kv_width``;
    h where no attention was found), at least one head's worth per TP rank where t exceeds the
    key/value heads (they are then replicated)."""
    if st.cp == 1:
        return 0.0
    width = profile.kv_width or profile.hidden
    heads = profile.heads or 1
    head_dim = profile.hidden / heads
    return 2.0 * st.micro_batch * st.seq * max(width / st.tp, head_dim) * profile.act_bytes


def kv_repeated_bytes(profile: ModelProfile, st: Strategy) -> float:
    """Bytes of the gathered keys and values once repeated to the query heads (what attention
    reads and keeps for backward): 2·b·s·h/t·act bytes (h = query heads × head dim)."""
    if st.cp == 1:
        return 0.0
    return 2.0 * st.micro_batch * st.seq * profile.hidden / st.tp * profile.act_bytes


def cp_phases_s(profile: ModelProfile, cluster: Cluster, st: Strategy) -> tuple[float, float]:
    """(forward, backward) seconds of one block's context-parallel collectives per micro-batch:
    an all-gather of K and of V over the cp group (each half of ``kv_gathered_bytes``, the
    gathered size), a reduce-scatter of their gradients in backward."""
    size = kv_gathered_bytes(profile, st) / 2
    if size == 0:
        return 0.0, 0.0
    link = comm.group_link(cluster, st.dims.axis("cp"))
    gather_a, gather_b = comm.coefficients("all_gather", st.cp, link, size)
    scatter_a, scatter_b = comm.coefficients("reduce_scatter", st.cp, link, size)
    return 2 * (gather_a + gather_b * size), 2 * (scatter_a + scatter_b * size)


def kv_extra_bytes(profile: ModelProfile, st: Strategy) -> float:
    """Activation bytes a block keeps beyond the profile at b / cp: attention keeps the whole
    sequence's keys and values, repeated to the query heads, in place of the local ones:
    (1 − 1/cp) of ``kv_repeated_bytes`` (the gathered ones they were repeated from are not
    kept: the repeat's backward needs no input)."""
    return kv_repeated_bytes(profile, st) * (1 - 1 / st.cp)


__all__ = ["cp_phases_s", "kv_extra_bytes", "kv_gathered_bytes", "kv_repeated_bytes"]
