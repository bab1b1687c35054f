"""``autopar profile-comm``: time the collectives the planner prices, on the groups it uses.

Run on every rank under torchrun. Groups are formed the way the mesh forms them: inside a
node, consecutive ranks in groups of 2, 4, … up to the ranks per node (TP and DP inside a
node); across nodes, ranks one node apart (a stride of the ranks per node), in groups of 2,
4, … up to the node count. Every group of a size runs at the same moment, as every group
of a mesh axis does in training, and each timed collective follows a short burst of compute
(after a barrier), as in training, where a collective follows the compute that made its
input: on CPUs, gloo's threads then have to wake, and ranks arrive with compute's skew
(measured here: a 1 MB all-reduce took 3.8 ms back to back, 5.7–10.5 ms after 40 ms of
matmuls). For each collective and message size (geometric, from
``min_bytes`` to ``max_bytes``) the median over repeats is taken on each rank and the
slowest rank's median kept; then time(S) = a + b·S is fitted by least squares on the
relative error, so that the latency-bound small messages and the bandwidth-bound large
ones both count. Sizes follow ``cost_models/comm.py``: S is the full tensor (the gathered
result of an all-gather, the input of a reduce-scatter).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.measurements import GROUP_COLLECTIVES, CollectiveFit, CommProfile
from autopar.mesh import partner
from autopar.runtime.distributed import groups_made, slowest_s

Progress = Callable[[int, int, str], None]


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min_bytes, min_bytes·factor, … up to max_bytes (multiples of 4 bytes: fp32 elements)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise AutoparError(f"message sizes: need 4 <= min ({min_bytes}) <= max ({max_bytes}) bytes")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s - s % 4)
        s *= factor
    return sizes


def fit_line(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(a, b) ≥ 0 minimising Σ ((a + b·S − t)/t)² (weighted least squares, weights 1/t²)."""
    w = [1 / t**2 for t in times]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes, strict=True))
    sy = sum(wi * y for wi, y in zip(w, times, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, times, strict=True))
    det = sw * sxx - sx * sx
    a, b = ((sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det) if det > 0 else (sy / sw, 0.0)
    if b < 0:  # time does not grow with size: all latency
        return sy / sw, 0.0
    if a < 0:  # through the origin: b = Σ w·x·y / Σ w·x²
        return 0.0, sxy / sxx
    return a, b


def groups_of(world: int, per_node: int) -> list[tuple[int, bool, list[list[int]]]]:
    """(group size, crosses nodes, the partition of all ranks into groups) for every group the
    planner's meshes use (see the module doc)."""
    nodes = world // per_node
    out = []
    n = 2
    while n <= per_node and per_node % n == 0:
        out.append((n, False, [list(range(i, i + n)) for i in range(0, world, n)]))
        n *= 2
    n = 2
    while n <= nodes and nodes % n == 0:
        parts = [
            [local + per_node * (block + i) for i in range(n)]
            for block in range(0, nodes, n)
            for local in range(per_node)
        ]
        out.append((n, True, parts))
        n *= 2
    return out


def _run(
    name: str, size: int, n: int, group: Any, peer: int | None, device: torch.device
) -> Callable[[], None]:
    """A closure issuing one ``name`` of ``size`` bytes on ``group`` (fp32 tensors; bf16 for a
    ``_bf16`` collective)."""
    dtype = torch.bfloat16 if name.endswith("_bf16") else torch.float32
    name = name.removesuffix("_bf16")
    numel = max(1, size // dtype.itemsize)
    if name == "all_reduce":
        x = torch.ones(numel, device=device, dtype=dtype)
        return lambda: dist.all_reduce(x, group=group)
    if name == "all_gather":
        shard = max(1, numel // n)
        x, out = torch.ones(shard, device=device), torch.empty(shard * n, device=device)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if name == "reduce_scatter":
        shard = max(1, numel // n)
        x = torch.ones(shard * n, device=device, dtype=dtype)
        out = torch.empty(shard, device=device, dtype=dtype)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    assert name == "send_recv" and peer is not None
    x = torch.ones(numel, device=device)
    first = dist.get_rank() < peer

    def ping_pong() -> None:  # two messages: the caller halves the time
        if first:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)

    return ping_pong


def _median_s(
    op: Callable[[], None],
    *,
    warmup: int,
    repeat: int,
    device: torch.device,
    busy: Callable[[], None] | None = None,
) -> float:
    """Median seconds of ``op``; with ``busy``, each repeat starts from a barrier followed by
    ``busy`` (untimed), so that ``op`` meets the state training leaves: threads that were idle
    during compute and ranks that arrive with compute's skew."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        op()
    sync()
    times = []
    for _ in range(repeat):
        if busy is not None:
            dist.barrier()
            busy()
            sync()
        t0 = time.perf_counter()
        op()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compute_burst(device: torch.device, seconds: float = 2e-3) -> Callable[[], None]:
    """Matmuls taking about ``seconds`` (count agreed across ranks: rank 0's)."""
    a = torch.randn(256, 256, device=device)

    def one_matmul() -> None:
        a @ a

    one = _median_s(one_matmul, warmup=2, repeat=5, device=device)
    k = torch.tensor([max(1, round(seconds / one))])
    dist.broadcast(k, 0)

    def burst() -> None:
        for _ in range(int(k)):
            a @ a

    return burst


def measure_overlap(size_bytes: int, device: torch.device, *, repeat: int = 5) -> float:
    """How much of an all-reduce of ``size_bytes`` over all ranks matmuls hide (see
    ``CommProfile.overlap``); the matmul loop is sized to take about as long as the
    all-reduce (the count agreed across ranks)."""
    x = torch.ones(max(1, size_bytes // 4), device=device)
    a = torch.randn(256, 256, device=device)

    def slowest(op: Callable[[], None]) -> float:
        dist.barrier()
        return slowest_s(_median_s(op, warmup=1, repeat=repeat, device=device))

    t_comm = slowest(lambda: dist.all_reduce(x))

    def one_matmul() -> None:
        a @ a

    t_mm = slowest(one_matmul)
    k = max(1, round(t_comm / t_mm))

    def compute() -> None:
        for _ in range(k):
            a @ a

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        compute()
        assert work is not None
        work.wait()

    t_compute, t_both = slowest(compute), slowest(both)
    hidden = (t_compute + t_comm - t_both) / min(t_compute, t_comm)
    return min(1.0, max(0.0, hidden))


@dataclass
class _Sweep:
    """One ``measure_comm`` run: each collective timed over the message sizes and fitted."""

    sizes: list[int]
    device: torch.device
    busy: Callable[[], None]
    warmup: int
    repeat: int
    total: int
    progress: Progress | None
    rank: int = field(default_factory=dist.get_rank)
    done: int = 0
    fits: list[CollectiveFit] = field(default_factory=list)

    def tick(self, done: int, what: str) -> None:
        if self.rank == 0 and self.progress:
            self.progress(done, self.total, what)

    def measure(
        self, name: str, n: int, crosses: bool, ops: Callable[[int], Callable[[], None]], halve: bool
    ) -> None:
        """Time ``ops(size)`` at every size (the slowest rank's median; a ping-pong ``halve`` d to
        one message), then fit time(S) = a + b·S."""
        times = []
        for size in self.sizes:
            self.tick(
                self.done, f"{name} over {n} ranks {'across nodes' if crosses else 'in a node'}, {size:,} B"
            )
            dist.barrier()
            reps = self.repeat if size <= 16 * 2**20 else 3
            op = ops(size)
            t = _median_s(op, warmup=self.warmup, repeat=reps, device=self.device, busy=self.busy)
            times.append(slowest_s(t / (2 if halve else 1)))
            self.done += 1
        a, b = fit_line(self.sizes, times)
        self.fits.append(
            CollectiveFit(
                collective=name,
                group_size=n,
                crosses_nodes=crosses,
                latency_s=a,
                seconds_per_byte=b,
                sizes_bytes=tuple(self.sizes),
                times_s=tuple(times),
            )
        )


def _groups(world: int, per_node: int) -> list[tuple[int, bool, Any]]:
    """(size, crosses nodes, this rank's process group) of every group ``groups_of`` lists
    (every rank creates every group, in the same order)."""
    rank, out = dist.get_rank(), []
    for n, crosses, parts in groups_of(world, per_node):
        group = None
        for ranks in parts:
            g = dist.new_group(ranks)
            if rank in ranks:
                group = g
        out.append((n, crosses, group))
    return out


def measure_comm(
    *,
    min_bytes: int = 4,
    max_bytes: int = 256 * 2**20,
    warmup: int = 2,
    repeat: int = 10,
    progress: Progress | None = None,
) -> CommProfile:
    """Measure and fit every collective on every group (call on every rank; rank 0's
    ``progress`` is called). Large messages (over 16 MiB) get 3 repeats."""
    world = dist.get_world_size()
    if world < 2:
        raise AutoparError(
            "profile-comm needs at least 2 ranks: torchrun --nproc-per-node N -m autopar profile-comm"
        )
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    sizes = message_sizes(min_bytes, max_bytes)
    with groups_made() as made:
        groups = _groups(world, per_node)
    profile = _measure_all(groups, sizes, device, warmup, repeat, progress, max_bytes)
    dist.barrier()  # a running job probes its links (``autopar.Adaptive``): leave no groups behind
    for group in made:
        dist.destroy_process_group(group)
    return profile


def _measure_all(
    groups: list[tuple[int, bool, Any]],
    sizes: list[int],
    device: torch.device,
    warmup: int,
    repeat: int,
    progress: Progress | None,
    max_bytes: int,
) -> CommProfile:
    """``measure_comm``'s sweep over ``groups`` (and the send/recv pairs, and the overlap)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    pairs = [(False, 1)] + ([(True, per_node)] if world // per_node >= 2 else [])
    total = (len(groups) * len(GROUP_COLLECTIVES) + len(pairs)) * len(sizes)
    sweep = _Sweep(sizes, device, compute_burst(device), warmup, repeat, total, progress)
    for n, crosses, group in groups:
        for name in GROUP_COLLECTIVES:
            sweep.measure(
                name,
                n,
                crosses,
                functools.partial(_run, name, n=n, group=group, peer=None, device=device),
                False,
            )
    for crosses, stride in pairs:
        peer = partner(rank, stride)
        if peer >= world:
            raise AutoparError(f"send/recv pairs need an even count of {'nodes' if crosses else 'ranks'}")
        ping_pong = functools.partial(_run, "send_recv", n=2, group=None, peer=peer, device=device)
        sweep.measure("send_recv", 2, crosses, ping_pong, True)
    sweep.tick(total, "overlap of an all-reduce with compute")
    overlap = measure_overlap(min(max_bytes, 16 * 2**20), device)
    sweep.tick(total, "done")
    return CommProfile(
        backend=str(dist.get_backend()),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        world_size=world,
        gpus_per_node=per_node,
        torch_version=torch.__version__,
        fits=tuple(sorted(sweep.fits, key=lambda f: (f.collective, f.crosses_nodes, f.group_size))),
        overlap=round(overlap, 3),
    )


__all__ = ["fit_line", "groups_of", "measure_comm", "message_sizes"]
