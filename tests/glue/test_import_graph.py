"""The package's import layers, read from the source with ``ast`` (no import runs).

Every ``import`` counts, the ones inside functions too: a lazy import still ties the two
modules together, and a circle of lazy imports is a circle a reader has to untangle.

* no import circle among ``vllm_specx``'s modules;
* ``vllm_specx/algorithms/`` (pure PyTorch) imports neither vLLM nor any ``vllm_specx``
  module outside ``algorithms/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "vllm_specx"
ALGORITHMS = "vllm_specx.algorithms"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def _imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name the module imports (``from a import b`` gives ``a`` and ``a.b``),
    relative imports resolved, at any depth of the module's code."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: None if is_package else -1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = _modules()
    return {
        name: {m for m in _imported_names(name, path) if m in modules and m != name}
        for name, path in modules.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_graph_reader_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    # The checks below are only as good as the reader: a lazy import inside a function
    # and a relative import must both count.
    pkg = tmp_path / "vllm_specx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from vllm_specx.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("from . import a\n")
    assert _imported_names("vllm_specx.sub.a", pkg / "sub" / "a.py") >= {"vllm_specx.sub.b"}
    assert "vllm_specx.sub.a" in _imported_names("vllm_specx.sub.b", pkg / "sub" / "b.py")
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the reader found the package
    cycles = import_cycles(graph)
    detail = "; ".join(
        " <-> ".join(c) + " (" + ", ".join(
            f"{m} imports {sorted(graph[m] & set(c))}" for m in c
        ) + ")"
        for c in cycles
    )
    assert not cycles, f"import circles in vllm_specx: {detail}"


def test_algorithms_import_nothing_above_them() -> None:
    modules = _modules()
    bad = []
    for name, path in sorted(modules.items()):
        if not (name == ALGORITHMS or name.startswith(ALGORITHMS + ".")):
            continue
        for imported in sorted(_imported_names(name, path)):
            top = imported.split(".")[0]
            inside = imported == ALGORITHMS or imported.startswith(ALGORITHMS + ".")
            parent = imported.rpartition(".")[0]
            if f"{name} imports {parent}" in bad:
                continue  # `from a import b` names a.b too: report a once
            if top == "vllm" or (top == "vllm_specx" and not inside):
                bad.append(f"{name} imports {imported}")
    assert not bad, "algorithms/ must stay pure PyTorch: " + "; ".join(bad)
