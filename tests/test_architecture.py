"""The package's shape (docs/architecture.md): imports form no cycle and never go up the
pipeline's layers; modules and functions stay small."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"autopar": "autopar", "autopar.passes": "passes", "autopar.cost_models": "cost_models"}
"""Installed package → folder (``passes/`` and ``cost_models/`` install under ``autopar``)."""

LAYERS = [
    (
        "autopar.errors",
        "autopar.files",
        "autopar.cache",
        "autopar.lazy",
        "autopar.units",
        "autopar.gpus",
        "autopar.spec_fields",
        "autopar.measurements",
        "autopar.cluster",
        "autopar.groups",
        "autopar.recompute_policy",
        "autopar.knobs",
        "autopar.mesh",
        "autopar.splits",
        "autopar.runs",
        "autopar.strategy",
    ),
    ("autopar.plan", "autopar.request"),
    ("autopar.graph", "autopar.zoo"),
    ("autopar.passes",),
    ("autopar.cost_models",),
    ("autopar.planner", "autopar.runtime"),
    ("autopar.measure", "autopar.monitor"),
    ("autopar.api", "autopar.adapt", "autopar.cli", "autopar.__main__", "autopar"),
]
"""Lowest first: a module may import its own layer or lower ones, and nothing above."""

MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "autopar" and parts and parts[0] in ("passes", "cost_models"):
                continue
            found[".".join([pkg, *parts])] = path
    return found


def _imports(tree: ast.AST) -> set[str]:
    """Every module an import statement names, anywhere in the file (inside functions too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for target in _imports(ast.parse(path.read_text())):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            # a submodule importing its own package's __init__ is Python's order, not a dependency
            if target and target != name and not name.startswith(target + "."):
                g.add_edge(name, target)
    return g


def _layer(module: str) -> int:
    best = max(
        (
            (i, p)
            for i, group in enumerate(LAYERS)
            for p in group
            if module == p or module.startswith(p + ".")
        ),
        key=lambda x: len(x[1]),
    )
    return best[0]


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        _layer(module)  # raises on a module no layer names


def test_no_import_cycle() -> None:
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_imports_never_go_up_the_pipeline() -> None:
    g = _graph()
    up = [(a, b) for a, b in g.edges if _layer(b) > _layer(a)]
    assert not up, f"imports from a lower layer into a higher one: {up}"
    stage = {m: [*m.split("."), ""][1] for m in g}
    planner_runtime = [(a, b) for a, b in g.edges if {stage[a], stage[b]} == {"planner", "runtime"}]
    assert not planner_runtime, f"the planner and the runtime must not import each other: {planner_runtime}"


def test_modules_and_functions_stay_small() -> None:
    big, long = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            big.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    long.append((f"{name}.{node.name}", length))
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_checks_can_fail(tmp_path) -> None:
    """The walker sees an import inside a function, and the layer table ranks it."""
    tree = ast.parse("def f():\n    from autopar.runtime import parallelize\n")
    assert "autopar.runtime" in _imports(tree)
    assert _layer("autopar.runtime.steps") > _layer("autopar.passes.tensor_parallel") > _layer("autopar.plan")
    assert _layer("autopar.cli.plan") > _layer("autopar.planner.search")
