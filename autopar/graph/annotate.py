"""Annotate every node with shape, dtype, FLOPs, parameter bytes and bytes saved for backward.

``annotate_costs(gm, inputs)`` runs the graph once on fake CPU tensors (no
memory, no compute) with parameters that require grad, and records per node:

- ``autopar.shape`` / ``autopar.dtype``: the output's shape and dtype (the
  first tensor output for multi-output nodes).
- ``autopar.fwd_flops``: FLOPs of the ATen kernels the node dispatches to,
  counted with PyTorch's own formula table (``torch.utils.flop_counter``);
  composite ops such as ``linear`` are counted through their decomposition.
- ``autopar.kernel_flops``: FLOPs the kernel executes, what time is priced from: the same as
  ``fwd_flops`` except for causal attention (``scaled_dot_product_attention(is_causal=True)``),
  whose flash kernels skip the key blocks above the diagonal (Dao 2023, FlashAttention-2 §3.1.1):
  a fraction (s + 1) / (2s) of the s² products. ``fwd_flops`` keeps the full count, the
  convention of model FLOPs and MFU (Chowdhery et al. 2022, PaLM, App. B).
- ``autopar.bwd_flops``: model-FLOPs convention (Narayanan et al. SC'21,
  §5.1 and Eq. 3): the backward of a contraction computes one product of the
  same size per operand that needs a gradient — input-grad and weight-grad —
  so bwd = fwd × min(2, operands requiring grad). Flash attention's
  recomputation of QKᵀ in backward is hardware FLOPs and is not counted here.
- ``autopar.param_bytes``: bytes of the parameter a ``get_attr`` node reads
  (0 for buffers and other nodes; a tied weight counts once).
- ``autopar.saved_bytes``: bytes of activation storage that the node's
  autograd formulas save for backward, measured with
  ``torch.autograd.graph.saved_tensors_hooks``. A storage is counted once,
  by the first node that saves it; parameters are not activations. The
  attention kernel is the one PyTorch picks for CPU tensors (flash attention:
  q, k, v, output and log-sum-exp), which is also what GPU training keeps;
  dropout runs as ``native_dropout``, which keeps a 1-byte mask as on GPUs.
- ``autopar.saved``: the saved storages behind ``saved_bytes`` as
  ``(shape of the first view saved, bytes)`` pairs, so cost models can tell
  residual-stream tensors (b, s, h) from tensor-parallel-sharded ones.
- ``autopar.mem_bytes``: bytes the kernel reads and writes (tensor inputs +
  outputs) for the roofline's memory term; 0 for ops that only make views.
- ``autopar.dispatch``: the ATen calls the node runs below autograd, in order
  (``graph.dispatch.DispatchCall``: operator, FLOPs, bytes moved, bytes its
  outputs own): what a per-operator recompute policy keeps or recomputes.
- ``autopar.expert``: a routed experts' grouped matmul (``graph.experts.GROUPED_MM``);
  ``autopar.expert_rows``: a node between a MoE layer's first and last grouped matmul, on
  rows whose count expert parallelism makes vary (tensor parallelism leaves them whole).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from autopar.graph.dispatch import DispatchCall, dispatch_call, ignored, storages, written
from autopar.graph.experts import GROUPED_MM, expert_groups, op_name, row_region

_aten = torch.ops.aten


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``, the routed experts' matmul of MoE models
    (Hugging Face's grouped experts, torchtitan): each row of ``a`` (S, K) meets the one expert
    matrix of ``b`` (E, K, N) its group names, 2·S·K·N; batched 3-D × 3-D, 2·E·M·K·N; 2-D × 2-D
    (groups along K, the weight gradient's form), 2·M·K·N."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    rows = a.shape[0] if a.dim() == 2 else a.shape[0] * a.shape[1]
    return 2 * rows * a.shape[-1] * b.shape[-1]


# PyTorch's table has the GPU attention kernels; the CPU flash kernel does the same math. Its
# table has no grouped matmul.
_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, **kw: sdpa_flop_count(
        q.shape, k.shape, v.shape
    ),
    _aten._grouped_mm: grouped_mm_flops,
}


class _FlopCounter(TorchDispatchMode):
    """Adds the FLOPs of every dispatched ATen op to ``self.flops`` and records each call
    (``self.calls``: what selective activation checkpointing decides over)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.calls: list[DispatchCall] = []
        self.made_by: dict[int, int] = {}  # storage → the call (index) that made it

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = 0
        if packet in flop_registry:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        elif packet in _EXTRA_FLOPS:
            flops = int(_EXTRA_FLOPS[packet](*args, **kwargs))
        elif op_name(packet) in GROUPED_MM:  # transformers' grouped_mm_fallback (≥ 5.25 on CPU)
            flops = grouped_mm_flops(*args, **kwargs)
        self.flops += flops
        if ignored(func):
            return out
        for storage in written(func, args, kwargs):  # a kept output must stay as it was made
            if storage in self.made_by:
                i = self.made_by[storage]
                self.calls[i] = dataclasses.replace(self.calls[i], keepable=False)
        call = dispatch_call(func, args, kwargs, out, flops)
        if call.out_bytes:
            self.made_by.update(dict.fromkeys(storages(out) - storages((args, kwargs)), len(self.calls)))
        self.calls.append(call)
        return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(x)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


class _CostInterpreter(fx.Interpreter):
    """Runs the graph on fake tensors and fills ``node.meta['autopar.*']``."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.mode = mode
        self.fakes: dict[int, torch.Tensor] = {}  # id(real attr) → fake (tied weights share)
        self.param_storages: set[int] = set()
        self.seen_storages: set[int] = set()
        self.keep: list[torch.Tensor] = []  # saved tensors stay alive until we are done
        self.node_saved: list[tuple[tuple[int, ...], int]] = []
        self.counter = _FlopCounter()
        self.node_calls: dict[fx.Node, tuple[int, int]] = {}  # node → its slice of counter.calls

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.param_storages and key not in self.seen_storages:
            self.seen_storages.add(key)
            self.node_saved.append((tuple(t.shape), t.untyped_storage().nbytes()))
        self.keep.append(t)
        return t

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        real = self.fetch_attr(str(target))
        if not isinstance(real, torch.Tensor):
            return real
        if id(real) not in self.fakes:
            with self.mode:
                fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="cpu")
            if isinstance(real, nn.Parameter) and real.requires_grad:
                fake.requires_grad_(True)
                self.param_storages.add(_storage_key(fake))
            self.fakes[id(real)] = fake
        return self.fakes[id(real)]

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        # A meta-device model traces ops with device=meta; we run them on fake CPU tensors.
        args, kwargs = tree_map(_cpu_device, (args, kwargs))
        if target is _aten.dropout.default and _fused_dropout(args, kwargs):
            # CPU dropout saves its mask in the input dtype; the GPU kernel keeps a bool mask.
            return _aten.native_dropout.default(args[0], args[1], True)[0]
        if target is _aten.histc.default and not args[0].is_floating_point():
            # Traced on the meta device, Hugging Face's grouped-MoE counts tokens per expert with an
            # integer histc, which the CPU lacks: the same (bins,) counts, computed in float.
            return _aten.histc.default(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.node_saved = []
        before, first_call = self.counter.flops, len(self.counter.calls)
        with self.mode, self.counter, torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            out = super().run_node(n)
        fwd = self.counter.flops - before
        # operands that need a gradient (checked only where there is a contraction)
        grad_operands = sum(1 for a in n.all_input_nodes if _requires_grad(self.env.get(a))) if fwd else 0
        first = next(_tensors(out), None)
        is_param = n.op == "get_attr" and isinstance(self.fetch_attr(str(n.target)), nn.Parameter)
        n.meta["autopar.shape"] = tuple(first.shape) if first is not None else ()
        n.meta["autopar.dtype"] = str(first.dtype).removeprefix("torch.") if first is not None else ""
        n.meta["autopar.fwd_flops"] = fwd
        n.meta["autopar.kernel_flops"] = round(fwd * causal_share(n))
        n.meta["autopar.expert"] = n.op == "call_function" and op_name(n.target) in GROUPED_MM
        # (a get_attr's calls make our fake parameters: the real graph reads a tensor)
        self.node_calls[n] = (first_call, len(self.counter.calls)) if n.op == "call_function" else (0, 0)
        n.meta["autopar.bwd_flops"] = fwd * min(2, grad_operands)
        n.meta["autopar.saved_bytes"] = sum(nbytes for _, nbytes in self.node_saved)
        n.meta["autopar.saved"] = tuple(self.node_saved)
        n.meta["autopar.mem_bytes"] = 0 if is_view(n) else _mem_bytes(n, out, self.env)
        n.meta["autopar.out_bytes"] = _nbytes(out)
        n.meta["autopar.param_bytes"] = _param_bytes(first) if is_param else 0
        n.meta["autopar.param"] = is_param  # a tied one too, whose bytes its first read counts
        return out


def causal_share(n: fx.Node) -> float:
    """Share of an attention node's products a causal flash kernel computes: (s + 1) / (2s) for
    ``is_causal=True`` over s queries and s keys (the diagonal blocks are computed whole, which
    the +1 rounds for); 1 otherwise (an explicit mask is applied to every score)."""
    if n.target != _aten.scaled_dot_product_attention.default:
        return 1.0
    causal = n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)
    q, k = (a.meta.get("val") for a in n.args[:2])  # type: ignore[union-attr]
    if not causal or q is None or k is None or q.shape[-2] != k.shape[-2]:
        return 1.0
    s = int(q.shape[-2])
    return (s + 1) / (2 * s)


def _fused_dropout(args: Any, kwargs: Any) -> bool:
    """Where ATen's dropout takes the fused GPU kernel: training and 0 < p < 1 (Dropout.cpp)."""
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    train = args[2] if len(args) > 2 else kwargs.get("train", True)
    return bool(train) and 0 < p < 1


def _cpu_device(x: Any) -> Any:
    return _CPU if isinstance(x, torch.device) and x.type == "meta" else x


_CPU = torch.device("cpu")


def is_view(n: fx.Node) -> bool:
    """Ops that alias their input (view, transpose, split, getitem, …) move no bytes."""
    if n.op != "call_function":
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is None:  # operator.getitem and other Python callables
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _mem_bytes(n: fx.Node, out: Any, env: dict[fx.Node, Any]) -> int:
    """Bytes a kernel reads and writes: every tensor input plus every tensor output."""
    read = sum(_nbytes(env.get(a)) for a in n.all_input_nodes)
    return read + sum(t.numel() * t.element_size() for t in _tensors(out))


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _requires_grad(x: Any) -> bool:
    return any(t.requires_grad for t in _tensors(x))


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _param_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def annotate_costs(gm: fx.GraphModule) -> fx.GraphModule:
    """Fill the cost annotations of every node of ``gm`` (see module doc); returns ``gm``.

    Placeholder shapes and dtypes come from their ``meta["val"]`` (set by export).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    specs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    with mode:
        args = [
            torch.zeros(v.shape, dtype=v.dtype, device="cpu") if isinstance(v, torch.Tensor) else v
            for v in specs
        ]
    interp = _CostInterpreter(gm, mode)
    seen_params: set[int] = set()
    interp.run(*args)
    for n, (first, last) in interp.node_calls.items():  # after the run: later writes are known
        n.meta["autopar.dispatch"] = tuple(interp.counter.calls[first:last])
    # A tied weight is read by two get_attr nodes: count its bytes once.
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.meta.get("autopar.param_bytes"):
            key = id(interp.fetch_attr(str(n.target)))
            if key in seen_params:
                n.meta["autopar.param_bytes"] = 0
            seen_params.add(key)
    for group in expert_groups(gm):  # rows whose count varies under expert parallelism
        for n in row_region(gm, group):
            n.meta["autopar.expert_rows"] = True
    return gm
