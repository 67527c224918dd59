"""No import circles among the project's modules: every import statement counts, those inside functions
too (a lazy import hides a circle, it does not break it); only imports for type checkers do not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # import name: folder (setup.py maps the kernels/ folder to llmserve_kernels)
    "llmserve": "llmserve",
    "inference_engine": "inference_engine",
    "llmserve_kernels": "kernels",
    "hostproject": "hostproject",
}


def _modules() -> dict[str, Path]:
    modules = {}
    for name, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[tuple[str, tuple[str, ...]]]:
    """What `module` imports, as (module, names from it), from anywhere in it but `if TYPE_CHECKING:`
    blocks; relative imports made absolute."""
    found: set[tuple[str, tuple[str, ...]]] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                package = package[: len(package) - node.level + (1 if is_package else 0)]
                base = ".".join(p for p in [*package, base] if p)
            found.add((base, tuple(alias.name for alias in node.names)))
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports. `from a.b import c` imports module a.b.c where there is
    one (a.b then is only its package, imported on the way like any parent package), else a name of a.b."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges = set()
        for base, names in _imported(
            ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"
        ):
            submodules = {f"{base}.{name}" for name in names} & modules.keys()
            edges |= submodules
            if len(submodules) < len(names) or not names:  # a name defined in base, or `import base`
                edges.add(base)
        graph[module] = {e for e in edges if e in modules and not _is_within(module, e)}
    return graph


def _is_within(module: str, package: str) -> bool:
    """An import of the module itself or of a package it is in: Python has run that package before the
    module, so the import orders nothing (where the package's top level imports the module and it wants a
    name the package has not yet defined, importing fails outright, in every test)."""
    return module == package or module.startswith(package + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, set(group)) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def test_the_walk_sees_lazy_imports_and_skips_type_checking_ones():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from a import b\n"
        "def f():\n    from .c import d\n    import e.f\n"
    )
    assert _imported(tree, "pkg.mod", is_package=False) == {
        ("typing", ("TYPE_CHECKING",)),
        ("pkg.c", ("d",)),
        ("e.f", ()),
    }
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z", "x"]]


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 100  # the walk found the packages
    found = cycles(graph)
    assert not found, "import circles (one through each group):\n" + "\n".join(" -> ".join(c) for c in found)
