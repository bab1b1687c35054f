"""Trace a model into a plain fx GraphModule of ATen ops with ``torch.export`` (non-strict).

Parameters and buffers become ``get_attr`` nodes that name the original
model's FQNs, so the GraphModule runs on the model's own weights and every
node keeps ``nn_module_stack`` (the owning module path).

A 96-layer model takes ~10 s to trace op by op. Most models repeat one block
many times, so when a model has a ModuleList of structurally identical blocks
(same classes, parameter shapes and plain attributes) we trace it with only
its first three blocks and splice copies of the middle block in for the rest
(``expand_repeated``): blocks 0 and 1 as traced, copies of block 1 for blocks
2..L-2, block 2's nodes (with whatever follows the last block) as block L-1.
If the traced graph does not have that periodic shape — e.g. a layer reads
the output of a layer two back — we fall back to tracing the whole model.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind

from autopar.errors import CaptureError
from autopar.graph.canonical import canonical
from autopar.graph.regions import inline_grad_regions

MIN_BLOCKS_TO_DEDUPE = 5
"""Below this many blocks the whole model is traced (splicing saves little)."""


@dataclass(frozen=True)
class RepeatedBlocks:
    """A ModuleList of identical blocks: ``parent.<attr>`` reachable as ``fqn``."""

    fqn: str
    parent: nn.Module
    attr: str
    count: int


CONSTANT_PREFIX = "_autopar_const_"
"""Attribute name prefix of a tensor constant the export lifted (``qkv[..., [-2]]``'s index list),
followed by its mangled path: kept on the graph's root module."""


def export_graph(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> fx.GraphModule:
    """Export ``model(*args, **kwargs)`` and convert it to a GraphModule rooted at ``model``.

    Raises ``CaptureError`` naming the module and source line when tracing fails.
    """
    try:
        with quiet_export_logs():
            ep = torch.export.export(model, args, dict(kwargs), strict=False)
    except Exception as e:
        raise capture_error(model, e) from e
    inline_grad_regions(ep.graph_module)  # no_grad regions: one flat graph
    return canonical(_to_graph_module(model, ep))


EXPORT_LOGGERS = {
    "torch.fx.experimental.symbolic_shapes": logging.ERROR,
    "torch._dynamo": logging.ERROR,
    "torch.export": logging.ERROR,
    "torch._export": logging.ERROR,
    "torch._subclasses.fake_tensor": logging.CRITICAL,  # its errors: a kernel's traceback, raised anyway
}
"""Loggers whose warnings (a whole printed graph on a data-dependent branch) would bury the one
line ``capture_error`` gives, and the level each is held at."""


@contextlib.contextmanager
def quiet_export_logs() -> Iterator[None]:
    """Only errors from torch.export's loggers while it runs (their levels restored after), and
    what it prints to stderr held back: on a failure it prints the partial graph, which the
    one-line error replaces; on success the held text is written out after all."""
    loggers = [logging.getLogger(name) for name in EXPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg, level in zip(loggers, EXPORT_LOGGERS.values(), strict=True):
        lg.setLevel(level)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
        sys.stderr.write(held.getvalue())
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _to_graph_module(model: nn.Module, ep: ExportedProgram) -> fx.GraphModule:
    """Replace lifted parameter/buffer placeholders with get_attr nodes on ``model``."""
    sig = ep.graph_signature
    lifted: dict[str, str] = {}
    constants: dict[str, Any] = {}
    constant_inputs: dict[str, Any] = {}
    for spec in sig.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            assert spec.target is not None
            lifted[spec.arg.name] = spec.target
        elif spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            constant_inputs[spec.arg.name] = spec.arg.value  # e.g. use_cache=False
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            assert spec.target is not None
            name = CONSTANT_PREFIX + re.sub(r"\W", "_", spec.target)
            lifted[spec.arg.name] = name
            constants[name] = ep.constants[spec.target]
    user_outputs = [i for i, spec in enumerate(sig.output_specs) if spec.kind == OutputKind.USER_OUTPUT]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in constant_inputs:
            env[node] = constant_inputs[node.name]
            continue
        if node.op == "placeholder" and node.name in lifted:
            new = graph.get_attr(lifted[node.name])
            new.meta = dict(node.meta)
        elif node.op == "output":
            outs = node.args[0]
            picked = [env[outs[i]] if isinstance(outs[i], fx.Node) else outs[i] for i in user_outputs]
            graph.output(picked[0] if len(picked) == 1 else tuple(picked))
            continue
        else:
            new = graph.node_copy(node, lambda n: env[n])
        env[node] = new
    holder = _ConstantHolder(model, constants)
    gm = graph_module(holder, graph, type(model).__name__ + "Graph")
    return gm


def graph_module(root: nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)``, keeping which of root's buffers are non-persistent (the
    constructor re-registers every buffer as persistent)."""
    gm = fx.GraphModule(root, graph, class_name=name)
    for path, mod in root.named_modules():
        for buf in mod._non_persistent_buffers_set:
            target = f"{path}.{buf}" if path else buf
            owner, _, attr = target.rpartition(".")
            with contextlib.suppress(AttributeError):  # not read by the graph: not copied
                gm.get_submodule(owner)._non_persistent_buffers_set.add(attr)
    gm.graph.lint()
    return gm


class _ConstantHolder(nn.Module):
    """Root for GraphModule: the model's attributes plus lifted constants."""

    def __init__(self, model: nn.Module, constants: Mapping[str, Any]) -> None:
        super().__init__()
        self._modules.update(model._modules)
        self._parameters.update(model._parameters)
        self._buffers.update(model._buffers)
        self._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
        for name, value in constants.items():
            setattr(self, name, value)


# ---- repeated blocks -------------------------------------------------------


def _signature(module: nn.Module) -> tuple[Any, ...]:
    """Everything that could make two blocks trace differently, except weight values."""
    plain = (int, float, str, bool, type(None))
    parts: list[Any] = []
    for name, sub in module.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(sub).items()
                if not k.startswith("_")
                and (isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)))
            )
        )
        parts.append((name, type(sub), attrs))
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        parts.append((name, tuple(t.shape), t.dtype, t.requires_grad))
    return tuple(parts)


def find_repeated_blocks(model: nn.Module) -> RepeatedBlocks | None:
    """The outermost ModuleList whose children are all structurally identical (≥2), if one."""
    found: list[RepeatedBlocks] = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        if any(fqn.startswith(f.fqn + ".") for f in found):
            continue  # nested inside a repeated block (e.g. MoE experts)
        sig = _signature(mod[0])
        if all(_signature(m) == sig for m in list(mod)[1:]):
            parent_fqn, _, attr = fqn.rpartition(".")
            found.append(RepeatedBlocks(fqn, model.get_submodule(parent_fqn), attr, len(mod)))
    return found[0] if len(found) == 1 else None


class truncated:
    """Context manager: temporarily keep only the first ``k`` blocks of ``rb``."""

    def __init__(self, rb: RepeatedBlocks, k: int) -> None:
        self.rb, self.k = rb, k
        self.full: nn.ModuleList | None = None

    def __enter__(self) -> None:
        self.full = getattr(self.rb.parent, self.rb.attr)
        assert self.full is not None
        self.rb.parent._modules[self.rb.attr] = nn.ModuleList(list(self.full)[: self.k])

    def __exit__(self, *exc: object) -> None:
        self.rb.parent._modules[self.rb.attr] = self.full


def block_index(node: fx.Node, prefix: str) -> int | None:
    """Index i of the repeated block ``prefix.i`` that ``node`` belongs to, if any."""
    if node.op == "get_attr":
        path = str(node.target)
        if path.startswith(prefix + "."):
            head = path[len(prefix) + 1 :].split(".", 1)[0]
            return int(head) if head.isdigit() else None
        return None
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        if path == prefix or not path.startswith(prefix + "."):
            continue
        head = path[len(prefix) + 1 :].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return None


class NotPeriodic(Exception):
    """The 3-block graph can't be extended by copying block 1 (fall back to a full trace)."""


def expand_repeated(gm: fx.GraphModule, rb: RepeatedBlocks, root: nn.Module) -> fx.GraphModule:
    """Splice a graph traced with blocks 0..2 into one for blocks 0..L-1 (see module doc)."""
    prefix = rb.fqn
    nodes = list(gm.graph.nodes)
    seg = _segments(nodes, prefix)
    body = _periodic_bodies(nodes, seg, prefix)
    sp = _Splice(
        prefix=prefix,
        count=rb.count,
        seg=seg,
        body=body,
        pos0={n: p for p, n in enumerate(body[0])},
        pos1={n: p for p, n in enumerate(body[1])},
        graph=fx.Graph(),
        env={},
        attr_cache={},
    )
    _splice_nodes(sp, nodes)
    new_gm = graph_module(root, sp.graph, gm.__class__.__name__)
    new_gm.graph.lint()
    return new_gm


def _segments(nodes: list[fx.Node], prefix: str) -> dict[fx.Node, int | None]:
    """Each node's segment in the 3-block graph: None prologue, 0/1/2 block+glue, 3 epilogue
    (-1 for a block's weights, which are matched by name, not order)."""
    seg: dict[fx.Node, int | None] = {}  # segment: None prologue, 0/1/2 block+glue, 3 epilogue
    current: int | None = None
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            seg[n] = None if block_index(n, prefix) is None else -1  # weights: by name, not order
            continue
        i = block_index(n, prefix)
        if i is not None:
            if current is not None and current not in (i, i - 1) and current != 3:
                raise NotPeriodic(f"block order {current} -> {i}")
            current = i
        elif current == 2 and n.op != "output":
            pass  # glue after the last block is treated as part of block 2's segment
        seg[n] = current if n.op != "output" else 3
    return seg


def _periodic_bodies(
    nodes: list[fx.Node], seg: dict[fx.Node, int | None], prefix: str
) -> dict[int, list[fx.Node]]:
    """The non-weight nodes of segments 0, 1 and 2, after checking the blocks repeat."""
    body = {k: [n for n in nodes if seg.get(n) == k and n.op not in ("get_attr",)] for k in (0, 1, 2)}
    if not body[0] or not body[1] or not body[2]:
        raise NotPeriodic("a block has no nodes")
    shape0 = [_op_key(n) for n in body[0]]
    if shape0 != [_op_key(n) for n in body[1]]:
        raise NotPeriodic("blocks 0 and 1 differ")
    own = [[_op_key(n) for n in body[k] if block_index(n, prefix) == k] for k in (1, 2)]
    if own[0] != own[1]:
        raise NotPeriodic("blocks 1 and 2 differ")
    return body


@dataclass(frozen=True, kw_only=True)
class _Splice:
    """What ``expand_repeated`` reads from the 3-block graph and the graph it builds."""

    prefix: str
    """FQN of the ModuleList of blocks."""
    count: int
    """L, the blocks of the full model."""
    seg: dict[fx.Node, int | None]
    """Segment of each traced node (``_segments``)."""
    body: dict[int, list[fx.Node]]
    """Non-weight nodes of segments 0, 1, 2."""
    pos0: dict[fx.Node, int]
    """Position of each node of block 0 in ``body[0]``."""
    pos1: dict[fx.Node, int]
    """Position of each node of block 1 in ``body[1]``."""
    graph: fx.Graph
    """The graph being built."""
    env: dict[fx.Node, fx.Node]
    """Traced node → its copy in ``graph`` (prologue, blocks 0, 1, L-1, epilogue)."""
    attr_cache: dict[str, fx.Node]
    """get_attr target → its one node in ``graph``."""


def _splice_nodes(sp: _Splice, nodes: list[fx.Node]) -> None:
    """Copy the traced nodes into ``sp.graph``, inserting copies of block 1 for blocks 2..L-2
    just before the first node of block 2 (which becomes block L-1)."""
    L = sp.count
    prev: list[fx.Node] = []  # the copy of the previous block, by position in block 1
    for n in nodes:
        s = sp.seg[n]
        if n.op == "get_attr":
            bi = block_index(n, sp.prefix)
            if bi == 2:
                sp.env[n] = _attr(sp, _rename(sp.prefix, str(n.target), 2, L - 1), n)
            elif bi is None or bi < 2:
                sp.env[n] = _attr(sp, str(n.target), n)
            continue
        if s == 2 and not prev:
            prev = list(map(sp.env.__getitem__, sp.body[1]))
            for j in range(2, L - 1):
                prev = _copy_block1(sp, prev, j)
        if s == 2:
            new = sp.graph.node_copy(n, functools.partial(_last_block_arg, sp, prev))
            _remap_stack(sp.prefix, new, 2, L - 1)
            sp.env[n] = new
            continue
        if s == 3 or (n.op == "output"):
            for a in n.all_input_nodes:
                if sp.seg.get(a) in (0, 1):
                    raise NotPeriodic(f"the output reads {a.name} from an early block")
        sp.env[n] = sp.graph.node_copy(n, sp.env.__getitem__)


def _attr(sp: _Splice, target: str, like: fx.Node) -> fx.Node:
    """The one get_attr node of ``target`` in the new graph (created with ``like``'s meta)."""
    if target not in sp.attr_cache:
        new = sp.graph.get_attr(target)
        new.meta = dict(like.meta)
        sp.attr_cache[target] = new
    return sp.attr_cache[target]


def _rename(prefix: str, target: str, src: int, dst: int) -> str:
    """``target`` with block ``prefix.src`` replaced by ``prefix.dst``."""
    return target.replace(f"{prefix}.{src}.", f"{prefix}.{dst}.", 1)


def _remap_stack(prefix: str, n: fx.Node, src: int, dst: int) -> None:
    """Point ``n``'s ``nn_module_stack`` at block ``dst`` instead of block ``src``."""
    stack = n.meta.get("nn_module_stack")
    if stack:
        n.meta["nn_module_stack"] = {
            k.replace(f"{prefix}.{src}", f"{prefix}.{dst}"): (
                p.replace(f"{prefix}.{src}", f"{prefix}.{dst}", 1) if p.startswith(f"{prefix}.{src}") else p,
                t,
            )
            for k, (p, t) in stack.items()
        }


def _copy_block1(sp: _Splice, prev: list[fx.Node], j: int) -> list[fx.Node]:
    """A copy of block 1 as block ``j``, reading the previous block's copy ``prev``."""
    out: list[fx.Node] = []
    local: dict[fx.Node, fx.Node] = {}
    for n in sp.body[1]:
        new = sp.graph.node_copy(n, functools.partial(_block1_arg, sp, prev, local, j))
        _remap_stack(sp.prefix, new, 1, j)
        local[n] = new
        out.append(new)
    return out


def _block1_arg(
    sp: _Splice, prev: list[fx.Node], local: dict[fx.Node, fx.Node], j: int, a: fx.Node
) -> fx.Node:
    """Input ``a`` of a block-1 node in its copy as block ``j``: the copy's own nodes
    (``local``), block j's weights, the previous copy in place of block 0, or the prologue."""
    if a in local:
        return local[a]
    if a.op == "get_attr" and block_index(a, sp.prefix) == 1:
        return _attr(sp, _rename(sp.prefix, str(a.target), 1, j), a)
    s = sp.seg.get(a)
    if s == 0:
        return prev[sp.pos0[a]]
    if s is None:
        return sp.env[a]
    raise NotPeriodic(f"block 1 reads {a.name} from segment {s}")


def _last_block_arg(sp: _Splice, prev: list[fx.Node], a: fx.Node) -> fx.Node:
    """Inputs of block 2's nodes, which become block L-1: block 1 → the last copy."""
    if sp.seg.get(a) == 1:
        return prev[sp.pos1[a]]
    if sp.seg.get(a) == 0:
        raise NotPeriodic(f"block 2 reads {a.name} from block 0")
    return sp.env[a]


def _op_key(n: fx.Node) -> tuple[Any, ...]:
    val = n.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    return (n.op, str(n.target), shape)


# ---- errors ----------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__)
_SKIP_DIRS = (_TORCH_DIR, os.path.dirname(inspect.__file__), os.path.dirname(__file__))


def capture_error(model: nn.Module, exc: BaseException) -> CaptureError:
    """One clear error for a failed trace: the user's module, file:line, reason and fix."""
    frames: list[traceback.FrameSummary] = []
    module_fqn, module_cls = "", type(model).__name__
    names = {id(m): n for n, m in model.named_modules()}
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        fname = frame.f_code.co_filename
        if not fname.startswith(_SKIP_DIRS):
            frames.append(traceback.FrameSummary(fname, tb.tb_lineno, frame.f_code.co_name))
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                module_fqn, module_cls = names[id(owner)], type(owner).__name__
        tb = tb.tb_next
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    data_dependent = any(
        k in str(exc)
        for k in ("data-dependent", "data dependent", "_local_scalar_dense", "GuardOnDataDependent")
    )
    fix = (
        "Python control flow there depends on a tensor's value; compute both branches with "
        "torch.where (or use torch.cond), or move the check out of forward()"
        if data_dependent
        else "make that code traceable by torch.export (non-strict), or capture a submodule"
    )
    where = ""
    if frames:
        f = frames[-1]
        src = (f.line or "").strip()
        where = f" at {f.filename}:{f.lineno}" + (f" `{src}`" if src else "")
    who = f"module '{module_fqn}' ({module_cls})" if module_fqn else f"model {module_cls}"
    if data_dependent:
        reason = "branches on the value of a tensor"
    return CaptureError(f"can't capture {who}{where}: {reason}. Fix: {fix}.")


def retarget(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Point the devices a graph traced on meta tensors baked into its operators (``arange(...,
    device=meta)``, ``_assert_tensor_metadata``) at ``device``."""

    def move(x: Any) -> Any:
        return device if isinstance(x, torch.device) and x.type == "meta" else x

    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.args = fx.node.map_aggregate(n.args, move)
            n.kwargs = fx.node.map_aggregate(n.kwargs, move)
    gm.recompile()
    return gm
