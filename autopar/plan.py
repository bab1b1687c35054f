"""The Plan: every decision the planner made, as data.

A ``Plan`` is frozen, round-trips through JSON exactly, prints as a short
diffable text, and names layers by their module names. ``validate_plan``
checks its invariants (degrees multiply to the GPU count, stages hold the
model's layers in order and none empty, batch divisible, memory fits, …).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from autopar.errors import AutoparError, PlanInvariantError
from autopar.strategy import SHARDING, Strategy


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline rank: its layers and the recompute choice of each block."""

    index: int
    """Pipeline rank (0 = first)."""
    layers: tuple[str, ...]
    """Layer names in execution order (the embedding on the first, the head on the last)."""
    recompute: tuple[tuple[str, str], ...]
    """(block name, recompute choice) for every block of the stage: none, selective, full or a
    per-operator policy of the strategy (``Strategy.policies``)."""
    peak_bytes: float
    """Predicted peak memory per GPU."""
    time_per_micro_batch_s: float
    """Predicted compute + recompute + TP communication per micro-batch."""
    comm_per_micro_batch_s: float = 0.0
    """Of which tensor-parallel communication (exposed)."""
    chunk_sizes: tuple[int, ...] = ()
    """Layers in each model chunk the stage runs, in order (interleaved: v chunks; the embedding
    and the head count as layers and may make a chunk alone); empty: one run per consecutive
    blocks."""

    @property
    def chunks(self) -> list[tuple[str, ...]]:
        """The stage's layers per model chunk it holds (v of them under the interleaved schedule):
        as ``chunk_sizes`` says, else runs of consecutive blocks (the embedding and head joining
        their neighbours)."""
        if self.chunk_sizes:
            starts = [sum(self.chunk_sizes[:i]) for i in range(len(self.chunk_sizes))]
            return [self.layers[a : a + n] for a, n in zip(starts, self.chunk_sizes, strict=True)]
        runs: list[list[str]] = []
        last = None
        for name in self.layers:
            index = re.search(r"(\d+)$", name)
            here = int(index.group(1)) if index else None
            if runs and (here is None or last is None or here == last + 1):
                runs[-1].append(name)
            else:
                runs.append([name])
            last = here if here is not None else last
        return [tuple(r) for r in runs]

    @property
    def layers_summary(self) -> str:
        """E.g. ``embed … blocks.3 (5)``; per chunk ``blocks.2 … blocks.3 | blocks.6 … head (5)``;
        past three chunks ``6 chunks: embed … blocks.1 | … | blocks.20 … blocks.21 (13)``."""
        spans = [f"{c[0]} … {c[-1]}" if len(c) > 1 else c[0] for c in self.chunks]
        shown = " | ".join(spans) if len(spans) <= 3 else f"{len(spans)} chunks: {spans[0]} | … | {spans[-1]}"
        return f"{shown} ({len(self.layers)})"

    @property
    def recompute_summary(self) -> str:
        """E.g. ``"14 none, 5 sac2"`` (``"-"`` for a stage without blocks), in block order."""
        counts: dict[str, int] = {}
        for _, r in self.recompute:
            counts[r] = counts.get(r, 0) + 1
        return ", ".join(f"{n} {c}" for c, n in counts.items()) or "-"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel training plan for one model on one cluster."""

    model: str
    """MODEL argument the plan was made for."""
    cluster: dict[str, Any]
    """The cluster (``Cluster.to_dict()``)."""
    strategy: Strategy
    """Degrees, ZeRO, micro-batching, schedule, sequence parallelism, dtype, layout."""
    mesh: tuple[tuple[str, int], ...]
    """Device-mesh axes, outermost first: (pp, p), (dp, d), (cp, c) when cp > 1, (tp, t)."""
    crosses_nodes: tuple[str, ...]
    """Mesh axes whose groups span more than one node."""
    stages: tuple[StagePlan, ...]
    """Per pipeline rank."""
    predicted: dict[str, Any]
    """The cost model's estimate (same keys as ``autopar estimate --json``)."""
    solve_time_s: float = field(default=0.0, compare=False)
    """Wall time of the search."""
    optimality_gap: float = 0.0
    """Largest relative MIP gap HiGHS proved on the chosen layout (0 = optimal)."""
    tensor_parallel: tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...] = ()
    """Per layer type, every operator's strategy as (op key ``module:op#k``, strategy, output
    placement), e.g. ("Block", (("attn.c_attn:linear#0", "column", "S2"), …)). Empty when tp = 1."""
    why: dict[str, Any] = field(default_factory=dict, compare=False)
    """The evidence, as ``autopar plan`` shows it: ``alternatives`` (runners-up, best first) and
    ``baselines`` (name → row, or None where it does not fit), each row a strategy with its
    predicted step time and how much slower than this plan. Not a decision: not in ``hash``."""
    node_groups: tuple[str, ...] = ()
    """On a mixed cluster (``groups.MixedCluster``): the node group of each node rank, node 0
    first — launch each group's nodes with those node ranks; a rank's group is its node's.
    Empty on one type of node."""

    @property
    def recompute(self) -> dict[str, str]:
        """Every block of every stage → its recompute choice (none, selective, full, a policy)."""
        return {name: choice for s in self.stages for name, choice in s.recompute}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``Plan.from_dict(p.to_dict()) == p``."""
        return {
            "model": self.model,
            "cluster": copy.deepcopy(self.cluster),
            "strategy": self.strategy.to_dict(),
            "mesh": [list(a) for a in self.mesh],
            "crosses_nodes": list(self.crosses_nodes),
            "stages": [
                {
                    "index": s.index,
                    "layers": list(s.layers),
                    "recompute": [list(r) for r in s.recompute],
                    "peak_bytes": s.peak_bytes,
                    "time_per_micro_batch_s": s.time_per_micro_batch_s,
                    "comm_per_micro_batch_s": s.comm_per_micro_batch_s,
                    "chunk_sizes": list(s.chunk_sizes),
                }
                for s in self.stages
            ],
            "predicted": copy.deepcopy(self.predicted),  # a copy: the Plan stays as it was
            "solve_time_s": self.solve_time_s,
            "optimality_gap": self.optimality_gap,
            "tensor_parallel": [[ltype, [list(op) for op in ops]] for ltype, ops in self.tensor_parallel],
            "why": copy.deepcopy(self.why),
            **({"node_groups": list(self.node_groups)} if self.node_groups else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Inverse of ``to_dict``; a malformed plan is a one-line ``AutoparError``."""
        if not isinstance(d, dict):
            raise AutoparError(
                f"not a plan: expected a JSON object, got {type(d).__name__}; "
                "is this a plan written by `autopar plan --out`?"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        optional = {"solve_time_s", "optimality_gap", "tensor_parallel", "why", "node_groups"}
        missing = sorted(known - set(d) - optional)
        if unknown or missing:
            what = (
                f"unknown plan field {unknown[0]!r}" if unknown else f"plan field {missing[0]!r} is missing"
            )
            raise AutoparError(f"{what}; is this a plan written by `autopar plan --out`?")
        try:
            return cls._build(d)
        except AutoparError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise AutoparError(
                f"malformed plan ({type(e).__name__}: {e}); is this a plan written by `autopar plan --out`?"
            ) from None

    @classmethod
    def _build(cls, d: dict[str, Any]) -> Plan:
        return cls(
            model=d["model"],
            cluster=d["cluster"],
            strategy=Strategy.from_dict(d["strategy"]),
            mesh=tuple((str(a), int(n)) for a, n in d["mesh"]),
            crosses_nodes=tuple(d["crosses_nodes"]),
            stages=tuple(
                StagePlan(
                    index=s["index"],
                    layers=tuple(s["layers"]),
                    recompute=tuple((str(a), str(b)) for a, b in s["recompute"]),
                    peak_bytes=s["peak_bytes"],
                    time_per_micro_batch_s=s["time_per_micro_batch_s"],
                    comm_per_micro_batch_s=s.get("comm_per_micro_batch_s", 0.0),
                    chunk_sizes=tuple(int(n) for n in s.get("chunk_sizes", ())),
                )
                for s in d["stages"]
            ),
            predicted=d["predicted"],
            solve_time_s=d.get("solve_time_s", 0.0),
            optimality_gap=d.get("optimality_gap", 0.0),
            tensor_parallel=tuple(
                (str(ltype), tuple((str(k), str(n), str(o)) for k, n, o in ops))
                for ltype, ops in d.get("tensor_parallel", [])
            ),
            why=dict(d.get("why", {})),
            node_groups=tuple(str(g) for g in d.get("node_groups", ())),
        )

    def to_json(self) -> str:
        """Stable JSON text (sorted keys)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of ``to_json``; text that is not a plan is a one-line ``AutoparError``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AutoparError(
                f"not a plan: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
            ) from None
        return cls.from_dict(data)

    @property
    def hash(self) -> str:
        """Short digest of the decisions (not the timings): equal on every rank of a job."""
        decisions = {k: v for k, v in self.to_dict().items() if k not in ("solve_time_s", "why")}
        return hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).hexdigest()[:16]

    def text(self) -> str:
        """A short, diffable description: one line for the knobs, one per stage."""
        st = self.strategy
        mesh = " × ".join(f"{a}{n}" for a, n in self.mesh)
        lines = [
            f"plan {self.model} on {cluster_title(self.cluster)}: mesh {mesh}"
            + (f" ({', '.join(self.crosses_nodes)} across nodes)" if self.crosses_nodes else ""),
            f"zero {st.zero}; micro-batch {st.micro_batch} × {st.micro_batches}"
            + (f" (per replica {', '.join(map(str, st.dp_shares))})" if st.dp_shares else "")
            + "; global batch "
            f"{st.global_batch}; seq {st.seq}; schedule {st.schedule}"
            + (f" v={st.virtual_stages}" if st.virtual_stages > 1 else "")
            + f"; sequence parallel {'on' if st.sequence_parallel else 'off'}"
            + ("; TP layout: leanest" if st.tp > 1 and st.tp_objective == "memory" else "")
            + f"; {st.dtype}"
            + _reduce_note(st)
            + (
                f"; HSDP: {st.dp_replicate} replicas of {st.dp_shard}-rank shard groups"
                if st.dp_replicate > 1
                else ""
            )
            + _expert_note(st, self.predicted)
            + (
                f"; context parallel {st.cp}: each sequence as {2 * st.cp} chunks of "
                f"{st.seq // (2 * st.cp)}, K/V all-gathered, gradients reduced over dp·cp = {st.dims.dp_cp}"
                if st.cp > 1
                else ""
            )
            + (f"; DDP buckets of {st.bucket_mb:g} MiB" if st.uses_ddp else "")
            + ("; each block compiled (torch.compile)" if st.compile == "block" else ""),
        ]
        lines.extend(_group_lines(self.node_groups, self.predicted))
        for s in self.stages:
            rc = s.recompute_summary
            lines.append(f"stage {s.index}: {s.layers_summary[:-1]} layers; recompute {rc})")
        lines.extend(_policy_lines(st, self.predicted, set(self.recompute.values())))
        for ltype, ops in self.tensor_parallel:
            lines.append(f"tensor parallel {ltype}: " + (", ".join(_tp_summary(ops)) or "all replicated"))
        return "\n".join(lines)


def cluster_title(cluster: dict[str, Any]) -> str:
    """``N× name`` of a plan's cluster, or each node group's for a mixed one."""
    if "groups" in cluster:
        groups = " + ".join(f"{g['num_nodes']}× {g['name']}" for g in cluster["groups"])
        return f"{cluster.get('name', 'mixed')} ({groups})"
    return f"{cluster['num_nodes']}× {cluster['name']}"


def _ranges(items: list[int]) -> str:
    """``0–3, 6`` for [0, 1, 2, 3, 6]."""
    # consecutive items keep the same difference from their position
    runs = [[i for _, i in run] for _, run in itertools.groupby(enumerate(items), key=lambda x: x[1] - x[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs)


def _group_lines(node_groups: tuple[str, ...], predicted: dict[str, Any]) -> list[str]:
    """A mixed plan's node ranks per group and what each group runs and waits."""
    if not node_groups:
        return []
    lines = []
    for g in predicted.get("groups", ()):
        nodes = [i for i, name in enumerate(node_groups) if name == g["group"]]
        lines.append(
            f"group {g['group']} ({g['gpus']}× {g['device']}; node ranks {_ranges(nodes)}): pipeline "
            f"ranks {_ranges(g['pipeline_ranks'])}, replicas {_ranges(g['replicas'])}, "
            f"{'/'.join(map(str, g['micro_batches']))} micro-batches each; busy {g['busy_s']:.3g} s, "
            f"idle {g['idle_s']:.3g} s of the step ({100 * g['idle_share']:.0f}%)"
        )
    return lines


def _expert_note(st: Strategy, predicted: dict[str, Any]) -> str:
    """Expert parallelism's layout and its all-to-alls' predicted time per step (ep > 1)."""
    if st.ep == 1:
        return ""
    a2a = predicted.get("breakdown_s", {}).get("ep_comm")
    cost = f", all-to-alls {a2a:.3g} s per step" if a2a is not None else ""
    skew = st.expert_skew
    priced = f", priced with the busiest rank at {skew:g}× an even share of rows" if skew > 1 else ""
    return (
        f"; expert parallel: each MoE layer's experts split over ep {st.ep} of the {st.dp} data-parallel "
        f"ranks (1/{st.ep} each; every row the model routes goes to its expert's rank and back, none "
        f"dropped), their states sharded over the {st.dp // st.ep} holding the same{cost}{priced}"
    )


def _reduce_note(st: Strategy) -> str:
    """The gradient reduction's dtype where it is not fp32, or its PowerSGD compression, and
    whether it loses precision."""
    if st.powersgd_rank:
        rank = st.powersgd_rank
        return f"; gradients compressed by PowerSGD at rank {rank} (lossy, allowed by --allow-lossy-comm)"
    if st.dp == 1 or st.grad_reduce == "fp32":
        return ""
    why = "lossy, allowed by --allow-lossy-comm" if st.lossy_comm else f"the precision of a {st.dtype} plan"
    return f"; gradients reduced in {st.grad_reduce} ({why})"


def _policy_lines(st: Strategy, predicted: dict[str, Any], used: set[str]) -> list[str]:
    """One line per per-operator policy the stages use: what it keeps, and its predicted bytes
    kept and recompute time per block and micro-batch (``predicted["recompute_choices"]``)."""
    priced = predicted.get("recompute_choices", {})
    lines = []
    for p in st.policies:
        if p.name not in used:
            continue
        line = f"recompute {p.name}: {p.summary}"
        cost, none, full = priced.get(p.name), priced.get("none"), priced.get("full")
        if cost and none and full:
            mib = (c["act_bytes"] / 2**20 for c in (cost, none, full))
            line += "; per block {:,.1f} MiB kept (none {:,.1f}, full {:,.1f})".format(*mib)
            line += f", {cost['recompute_s'] * 1e3:,.2f} ms redone (full {full['recompute_s'] * 1e3:,.2f})"
        lines.append(line)
    return lines


def _tp_summary(ops: tuple[tuple[str, str, str], ...]) -> list[str]:
    """One entry per sharded module: ``attn.c_attn column``, ``attn heads`` …"""
    seen: dict[str, str] = {}
    for key, name, _ in ops:
        if name in SHARDING:
            seen.setdefault(key.split(":")[0] or "(block)", name)
    return [f"{m} {n}" for m, n in seen.items()]


def validate_plan(
    plan: Plan, *, world_size: int, layer_names: tuple[str, ...], capacity_bytes: float
) -> None:
    """Raise ``PlanInvariantError`` naming the first invariant ``plan`` breaks: the degrees
    multiply to the GPU count, the batch splits, one stage per pipeline rank with v non-empty
    chunks each, and the chunks in model order (chunk c on ``Strategy.chunk_rank(c)``) are
    ``layer_names`` exactly — the embedding first, every block once and in order, the head
    last; every stage fits ``capacity_bytes``; recompute choices are the strategy's."""
    st = plan.strategy
    p, v = st.pp, st.virtual_stages
    chunks = [list(s.chunks) if v > 1 else [s.layers] for s in plan.stages]
    whole = all(len(c) == v and all(c) for c in chunks)
    ordered: list[str] = []
    for c in range(p * v):  # model order: chunk c is the next unused chunk of its rank
        rank = st.chunk_rank(c)
        ordered += chunks[rank].pop(0) if rank < len(chunks) and chunks[rank] else ["<missing chunk>"]
    checks = (
        (st.world_size == world_size, f"tp·pp·dp = {st.world_size}, not the cluster's {world_size} GPUs"),
        (st.global_batch % (st.dp * st.micro_batch) == 0, "the batch does not split over dp × micro-batch"),
        (len(plan.stages) == p, f"{len(plan.stages)} stages for pp = {p}"),
        (whole, f"a stage without {v} non-empty chunks"),
        (
            ordered == list(layer_names),
            f"the stages' chunks in model order are {_first_difference(ordered, layer_names)}",
        ),
        (all(s.peak_bytes <= capacity_bytes for s in plan.stages), "a stage's peak exceeds the memory"),
        ({r for s in plan.stages for _, r in s.recompute} <= set(st.choices), "an unknown recompute choice"),
    )
    for holds, what in checks:
        if not holds:
            raise PlanInvariantError(f"plan {plan.model}: {what} (a planner bug: please report it)")


def _first_difference(got: list[str], want: tuple[str, ...]) -> str:
    """Where ``got`` leaves the model's layer order ``want``: position, what is there, what should be."""
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    there = got[i] if i < len(got) else "nothing"
    return f"{there!r} at position {i} where the model has {want[i] if i < len(want) else 'nothing'!r}"
