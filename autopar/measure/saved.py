"""Bytes a block keeps for backward, measured: what its autograd graph holds after the forward.

``retained_bytes(forward, inputs)`` runs ``forward`` on fresh inputs under a dispatch mode that
takes a weak reference to the storage of every tensor an operator makes, drops every reference
it holds but the output, and sums the storages still alive: exactly what autograd saved (and,
under checkpointing, what the checkpoint kept: its input and a selective policy's cached
outputs). It measures every recompute choice the same way, on any device, with real tensors.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autopar.graph.dispatch import DispatchCall, dispatch_call, ignored, numbered


def tensors(x: Any) -> list[torch.Tensor]:
    """The tensors among ``x``'s leaves (nested tuples, lists, dicts)."""
    leaves, _ = tree_flatten(x)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


class _Storages(TorchDispatchMode):
    """Weak references to every storage an operator makes."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        known = self.refs.get(storage._cdata)
        if known is None or known() is None:  # a freed storage's address may be reused
            self.refs[storage._cdata] = weakref.ref(storage)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        read = {t.untyped_storage()._cdata for t in tensors((args, kwargs))}
        for t in tensors(out):  # new storage only (a view of a parameter is the parameter)
            if t.untyped_storage()._cdata not in read:
                self.track(t)
        return out


class _Calls(TorchDispatchMode):
    """Each call's operator and the bytes of the storage its outputs own (``graph.dispatch``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[DispatchCall] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not ignored(func):
            local = tree_map(_local, (args, kwargs, out))
            self.calls.append(dispatch_call(func, local[0], local[1], local[2], 0))
        return out


def _local(x: Any) -> Any:
    """A DTensor's local shard (the bytes this rank holds); anything else as it is."""
    return x.to_local() if hasattr(x, "to_local") else x


def held(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this rank holds: a DTensor's local shard (read, no operator
    run: a dispatch mode may ask inside its handler), else ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def call_bytes(run: Callable[[], Any]) -> dict[str, int]:
    """Bytes each call of one forward ``run()`` makes its outputs own, by ``op#k`` (the k-th call
    of operator ``op``, as a per-operator recompute policy names it): what keeping it costs."""
    mode = _Calls()
    with mode:
        run()
    keys = numbered(mode.calls)
    return {k: c.out_bytes for k, c in zip(keys, mode.calls, strict=True) if c.keepable}


Inputs = Callable[[], tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]]]
"""Makes a fresh (input, other args, kwargs) for one forward: the input's storage counts when
the block keeps it; the other arguments (position tables, masks) are shared and do not."""


def retained_bytes(forward: Callable[..., Any], inputs: Inputs) -> int:
    """Bytes of the storages that ``forward(x, *args, **kwargs)``'s autograd graph keeps alive
    for backward, the input ``x`` included where it is kept, the output excluded."""
    mode = _Storages()
    x, args, kwargs = inputs()
    mode.track(x)
    with mode:
        out = forward(x, *args, **kwargs)
    del x
    outputs = {t.untyped_storage()._cdata for t in tensors(out)}
    gc.collect()
    alive = (ref() for key, ref in mode.refs.items() if key not in outputs)
    total = sum(s.nbytes() for s in alive if s is not None)
    del out, args, kwargs
    return total


class PeakMode(TorchDispatchMode):
    """The most bytes the storages an operator made were ever alive at once (a DTensor's: its
    local shard's, the bytes this rank holds). A storage resized in place (FSDP2 frees an
    unsharded parameter with ``resize_(0)`` and refills it with ``resize_(n)``) counts at its
    size of the moment, wherever it was made: ``UntypedStorage.resize_`` is not dispatched, so the
    mode wraps it while active, as ``torch.distributed._tools.mem_tracker.MemTracker`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}
        self._resize: Any = None

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def _track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` at its size of the moment (a new one until it is freed)."""
        key, nbytes = storage._cdata, storage.nbytes()
        if key not in self.sizes:
            freed = weakref.finalize(storage, self._freed, key)
            freed.atexit = False  # a count, nothing to release at exit
        self.live += nbytes - self.sizes.get(key, 0)
        self.sizes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def __enter__(self) -> Self:
        resize, mode = torch.UntypedStorage.resize_, self

        def counted(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            if storage._cdata in mode.sizes or size > 0:
                mode._track(storage)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = counted  # type: ignore[method-assign, assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        read = {held(t).untyped_storage()._cdata for t in tensors((args, kwargs))}
        for t in tensors(out):
            storage = held(t).untyped_storage()
            if storage._cdata in read or storage._cdata in self.sizes:  # a view, in place, a second output
                continue
            self._track(storage)
        return out


def peak_bytes(run: Callable[[], Any]) -> int:
    """The peak of the bytes alive at once in storages that ``run()``'s operators made,
    forward and backward (autograd runs its backward operators under the same mode): what a
    caching allocator's ``max_memory_allocated`` would add during ``run``, on any device."""
    mode = PeakMode()
    with mode:
        run()
    return mode.peak


__all__ = ["Inputs", "PeakMode", "call_bytes", "held", "peak_bytes", "retained_bytes", "tensors"]
