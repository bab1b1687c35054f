"""``autopar.mesh.ParallelDims`` against torch's own device mesh (fake process groups: every
rank's view in one process), and the tree read for rank arithmetic anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.distributed as dist

from autopar.mesh import ParallelDims, partner
from autopar.strategy import Strategy

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "autopar", ROOT / "cost_models", ROOT / "passes"]
OWNER = ROOT / "autopar" / "mesh.py"
DEGREES = {"tp", "pp", "dp", "ep", "dp_shard", "dp_replicate", "edp"}

MESHES = [
    ParallelDims(pp=2, dp=2, tp=2),
    ParallelDims(pp=2, dp=4, tp=2, dp_replicate=2),
    ParallelDims(pp=2, dp=4, tp=2, ep=2),
    ParallelDims(pp=3, dp=2, tp=1, ep=2),
    ParallelDims(pp=1, dp=6, tp=2, dp_replicate=3),
    ParallelDims(pp=4, dp=1, tp=2),
    ParallelDims(pp=2, dp=2, tp=2, cp=2),
]


def _is_rank(node: ast.expr) -> bool:
    """A global rank: ``get_rank()``, ``rank``, ``x.rank``, ``global_rank``, or such divided
    already (``(rank // tp) % dp``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv | ast.Mod):
        return _is_rank(node.left)
    if isinstance(node, ast.Call):
        return ast.unparse(node.func).endswith("get_rank")
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "rank" or name.endswith("_rank")


def _why(node: ast.AST) -> str:
    """What rank arithmetic ``node`` is, or "": a ``stride=`` argument, mesh dims spelled out, a
    rank divided or taken modulo, a product of two parallel degrees (a group's stride or the
    size of a group ``ParallelDims`` names), a device mesh's rank tensor read."""
    if isinstance(node, ast.keyword) and node.arg == "stride":
        return "stride= argument"
    if isinstance(node, ast.keyword) and node.arg == "mesh_dim_names":
        return "mesh dims spelled out" if isinstance(node.value, ast.Tuple | ast.List) else ""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv | ast.Mod):
        return "a rank's coordinate" if _is_rank(node.left) else ""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        sides = (node.left, node.right)
        degrees = all(isinstance(s, ast.Attribute) and s.attr in DEGREES for s in sides)
        return "a product of degrees" if degrees else ""
    if isinstance(node, ast.Attribute) and node.attr == "mesh" and "mesh" in ast.unparse(node.value).lower():
        return "a device mesh's rank tensor"
    return ""


def _rank_arithmetic(path: Path) -> list[str]:
    """Lines of ``path`` that compute a stride or a coordinate (``_why``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if bad := _why(node):
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            found.append(f"{where}:{getattr(node, 'lineno', '?')}: {bad}: {ast.unparse(node)[:60]}")
    return found


def test_no_module_but_the_mesh_computes_rank_strides() -> None:
    """As the import-cycle test does for cycles: rank layout is ``autopar.mesh``'s alone."""
    files = [p for folder in SOURCES for p in sorted(folder.rglob("*.py")) if p != OWNER]
    assert len(files) > 100
    found = [line for p in files for line in _rank_arithmetic(p)]
    assert not found, "rank arithmetic outside autopar/mesh.py (ask ParallelDims):\n" + "\n".join(found)


def test_the_check_sees_rank_arithmetic(tmp_path) -> None:
    """What the tree held before the mesh had an owner is caught (the check can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(st, dist, mesh, comm, c):\n"
        "    a = comm.group_link(c, size=st.dp, stride=st.tp)\n"
        "    b = (dist.get_rank() // st.tp) % st.dp\n"
        "    d = st.tp * st.dp\n"
        "    e = mesh.mesh[0, 1, 2]\n"
    )
    found = _rank_arithmetic(bad)
    assert len(found) == 5, found  # stride=, // and % of the rank, the product, the rank tensor
    fine = tmp_path / "fine.py"  # a shard's offset from a TP-local rank, a per-rank share
    fine.write_text(
        "def g(self, vocab, ranks, names):\n    return self.rank * vocab // self.t, 2**30 // ranks\n"
    )
    assert _rank_arithmetic(fine) == []


@pytest.fixture
def fake_world():
    """A fake process group per (rank, world): torch's view of the mesh from any rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("dims", MESHES, ids=lambda d: "x".join(f"{n}{s}" for n, s in d.mesh_dims))
def test_groups_are_torchs(dims: ParallelDims, fake_world) -> None:
    """Every rank's group along every mesh dim and flattened dim is the one torch's
    ``init_device_mesh`` gives it; coordinates index the groups; groups partition the world."""
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = zip(*dims.mesh_dims, strict=True)
    for rank in range(dims.world_size):
        fake_world(rank, dims.world_size)
        root = init_device_mesh("cpu", shape, mesh_dim_names=names)
        meshes = {name: root[name] for name in names}
        meshes |= {name: root[parts]._flatten(name) for name, parts in dims.flattened.items()}
        for name, mesh in meshes.items():
            torch_ranks = dist.get_process_group_ranks(mesh.get_group())
            assert dims.group(rank, name) == torch_ranks, (rank, name)
            assert mesh.get_local_rank() == dims.coordinate(rank, name), (rank, name)
    for name, axis in dims.axes.items():
        groups = dims.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size)), name
        assert all(len(g) == axis.size for g in groups)
        assert all(dims.group(r, name)[dims.coordinate(r, name)] == r for r in range(dims.world_size))


def test_logical_axes_and_nodes() -> None:
    """The halves of a dp the mesh does not split, a stage's ranks, tied-weight groups, which
    groups leave a node, and the degrees from a Strategy."""
    plain = ParallelDims(pp=2, dp=4, tp=2)
    assert plain.axis("dp_shard") == plain.axis("dp").__class__("dp_shard", 4, 2)
    assert (plain.axis("dp_replicate").size, plain.axis("ep").size, plain.axis("edp").size) == (1, 1, 4)
    assert plain.axis("stage").size == 8 and plain.coordinate(13, "pp") == 1
    assert plain.groups("pp", along=(0, 1))[:2] == [[0, 8], [1, 9]]
    assert plain.crossing(8) == ("pp",) and plain.crossing(4) == ("pp", "dp") and plain.crossing(16) == ()
    hsdp = ParallelDims(pp=1, dp=8, tp=2, dp_replicate=2)
    assert hsdp.axis("dp_replicate").crosses_nodes(8) and not hsdp.axis("dp_shard").crosses_nodes(8)
    st = Strategy(tp=2, pp=2, dp=4, ep=2, global_batch=8, micro_batch=1)
    assert st.dims == ParallelDims(pp=2, dp=4, tp=2, ep=2) and st.dims.axis("edp").stride == 4
    assert plain.axis("cp").size == 1 and plain.axis("dp_cp") == plain.axis("dp").__class__("dp_cp", 4, 2)
    context = ParallelDims(pp=2, dp=2, cp=2, tp=2)  # cp between dp and tp, its gradient group dp·cp
    assert context.mesh_dims == (("pp", 2), ("dp", 2), ("cp", 2), ("tp", 2)) and context.fsdp_dims == (
        "dp_cp",
    )
    assert context.group(5, "cp") == [5, 7] and context.group(5, "dp_cp") == [1, 3, 5, 7]
    with pytest.raises(KeyError, match="no mesh axis 'sp'"):
        plain.axis("sp")
    with pytest.raises(ValueError, match="cp 2 runs without HSDP"):
        ParallelDims(dp=4, cp=2, dp_replicate=2)
    with pytest.raises(ValueError, match="dp 4 must split"):
        ParallelDims(dp=4, ep=2, dp_replicate=2)
    assert [partner(r, 2) for r in range(8)] == [2, 3, 0, 1, 6, 7, 4, 5]
