"""Timing one layer or one optimizer step on the local device, as training would run it: caches
flushed before every timed region, CUDA events on a GPU (a sync and ``perf_counter`` elsewhere),
medians over repeats, the bytes autograd saves counted with saved-tensor hooks."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.errors import AutoparError

FLUSH_BYTES = {"cpu": 64 * 2**20, "cuda": 256 * 2**20}
"""Bytes written between timed regions to evict the caches (CPU LLC up to 32 MiB here; H200 L2
about 60 MB)."""


def _logits(out: Any) -> Any:
    """The (batch, seq, vocab) logits among a model's outputs."""
    leaves, _ = tree_flatten(out.logits if hasattr(out, "logits") else out)
    found = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point()]
    if not found:
        raise AutoparError("profiling the head needs logits of shape (batch, seq, vocab) among its outputs")
    return found[0]


class _Timer:
    """Seconds between marks: CUDA events on a GPU, perf_counter after a sync elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def spans_s(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


@contextlib.contextmanager
def _count_saved(stage: nn.Module, total: list[int]) -> Iterator[None]:
    """Add the bytes of the distinct tensors autograd saves (weights excluded) to total[0]."""
    weights = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
        for p in stage.parameters()
    }
    seen: set[int] = set()

    def pack(x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if hasattr(x, "to_local") else x
        ptr = local.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in seen:
            seen.add(ptr)
            total[0] += local.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield


def next_token_loss(tokens: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """The head's loss for a model that returns logits: next-token cross-entropy on ``tokens``."""
    from autopar.runtime.loss import lm_loss

    return lambda out: lm_loss(_logits(out), tokens)


def _forward(
    stage: nn.Module,
    xs: list[torch.Tensor],
    loss: Callable[[Any], torch.Tensor] | None,
    half: torch.dtype | None,
    saved: list[int] | None,
) -> Any:
    """One forward (the head's includes the loss); ``saved``: add the bytes it saves."""
    device = next(stage.parameters()).device
    with (
        torch.autocast(device.type, dtype=half) if half else contextlib.nullcontext(),
        _count_saved(stage, saved) if saved is not None else contextlib.nullcontext(),
        _vocab_parallel(loss is not None),
    ):
        out = stage(*xs)
        if loss is not None:
            out = loss(out)
    return out


def forward_once(stage: nn.Module, inputs: Sequence[torch.Tensor], half: torch.dtype | None) -> Any:
    """One forward of a (non-head) stage on fresh copies of ``inputs``, as ``time_layer`` runs it."""
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    return _forward(stage, xs, None, half, None)


def _backward(out: Any, loss: Callable[[Any], torch.Tensor] | None) -> None:
    """The loss's backward (the head), or a random gradient on every output that needs one."""
    if loss is not None:
        with _vocab_parallel(True):
            out.backward()
        return
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
    torch.autograd.backward(leaves, [torch.randn_like(x) for x in leaves])


def time_layer(
    stage: nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    loss: Callable[[Any], torch.Tensor] | None,
    half: torch.dtype | None,
    warmup: int,
    repeat: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[LayerTimingParts, list[torch.Tensor]]:
    """Median forward and backward seconds of ``stage`` on ``inputs``; with ``loss`` (of its
    output) the stage is the head and its forward includes the loss. Also returns one forward's
    outputs (detached), the next stage's inputs. ``sync`` runs after each (untimed) cache
    flush: under torchrun, a barrier, so that no rank's flush overlaps another's timed region."""
    device = next(stage.parameters()).device
    cuda = device.type == "cuda"
    # Training runs the other layers between this layer's forward and backward, so its weights
    # and activations are not in cache: overwrite a buffer twice the last-level cache before
    # each timed region (as Triton's do_bench does), or the profile is optimistic.
    flush = torch.empty(FLUSH_BYTES[device.type] // 4, dtype=torch.float32, device=device)
    fwd, bwd = [], []
    saved = [0]
    peak: int | None = None
    outputs: list[torch.Tensor] = []
    for i in range(warmup + repeat):
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        timer = _Timer(device)
        counting = i == warmup
        flush.zero_()
        sync()
        if counting and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        timer.mark()
        out = _forward(stage, xs, loss, half, saved if counting else None)
        timer.mark()
        flush.zero_()
        sync()
        timer.mark()
        _backward(out, loss)
        timer.mark()
        f, _, b = timer.spans_s()
        if counting and cuda:
            peak = int(torch.cuda.max_memory_allocated() - base)
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
        if i == 0:
            outputs = [x.detach() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        stage.zero_grad(set_to_none=True)
    return LayerTimingParts(statistics.median(fwd), statistics.median(bwd), saved[0], peak), outputs


@dataclasses.dataclass(frozen=True)
class LayerTimingParts:
    """What ``time_layer`` measures: forward s, backward s, saved bytes, GPU peak bytes."""

    forward_s: float
    backward_s: float
    saved_bytes: int
    peak_bytes: int | None


@contextlib.contextmanager
def _vocab_parallel(on: bool) -> Iterator[None]:
    """``loss_parallel`` while a process group exists (logits split over the vocabulary)."""
    import torch.distributed as dist

    if not on or not dist.is_initialized():
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def optimizer_s_per_param(
    params: Sequence[nn.Parameter], *, warmup: int, repeat: int, sync: Callable[[], None] = lambda: None
) -> float:
    """Median AdamW step seconds per parameter (the runtime's default optimizer, foreach), per
    parameter of the tensors given (local shards of DTensors)."""
    plain = [nn.Parameter(p.detach().clone()) for p in params]  # DTensors stay DTensors
    for p in plain:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(plain, lr=1e-3)
    device = plain[0].device
    times = []
    flush = torch.empty(FLUSH_BYTES[device.type] // 4, dtype=torch.float32, device=device)
    for i in range(warmup + repeat):
        flush.zero_()  # a step's states are not in cache: the model's are larger than one block's
        sync()
        timer = _Timer(device)
        timer.mark()
        opt.step()
        timer.mark()
        if i >= warmup:
            times.append(timer.spans_s()[0])
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in plain)
    return statistics.median(times) / local


__all__ = ["FLUSH_BYTES", "LayerTimingParts", "forward_once", "optimizer_s_per_param", "time_layer"]
