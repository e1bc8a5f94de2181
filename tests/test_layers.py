"""The package's layers import downward only, and no modules import each other in a cycle.

The layers, bottom to top (STYLE.md principle 13)::

    errors, config, layout, tasks, types, cuda_lib, native_build   (the base)
    memory | storage | copy                                        (siblings)
    transfer
    core
    ops, tools, integrations, engine, the package itself           (the top)

A module may import its own part of the package, or any part of a lower
layer. The base and the top are each one part; memory, storage and copy are
three parts that do not import each other. Every import counts: at module
level, inside functions (lazy) and under ``TYPE_CHECKING``, because each is
an edge a reader has to follow. The graph is read with ``ast``; nothing is
imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "kvcached"
ROOT = Path(__file__).resolve().parents[1]

BASE = ("errors", "config", "layout", "tasks", "types", "cuda_lib", "native_build")
TOP = ("ops", "tools", "integrations", "engine", "__main__", "")
LAYERS = ["/".join(BASE), "memory | storage | copy", "transfer", "core",
          "/".join(p or "kvcached" for p in TOP)]
LEVEL = {"memory": 1, "storage": 1, "copy": 1, "transfer": 2, "core": 3,
         **{p: 0 for p in BASE}, **{p: 4 for p in TOP}}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``src`` (a module) imports ``dst`` at ``file:line``."""

    src: str
    dst: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.src} imports {self.dst}"


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    mods = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _owner(name: str, mods: dict) -> str | None:
    """The package module that ``name`` (a module, or a name in one) is defined in."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, module: str, is_pkg: bool, mods: dict) -> list[str]:
    """The package modules an import statement runs (parents' ``__init__`` aside)."""
    if isinstance(node, ast.Import):
        return [t for a in node.names if (t := _owner(a.name, mods))]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in mods else _owner(base, mods))  # a submodule, or a name
    return [t for t in out if t]


def import_edges() -> list[Import]:
    """Every import between two modules of the package, lazy ones included."""
    mods = package_modules()
    edges = []
    for module, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for dst in _targets(node, module, is_pkg, mods):
                if dst != module:
                    edges.append(Import(module, dst, str(path.relative_to(ROOT)), node.lineno))
    return edges


def part(module: str) -> str:
    """The layer part a module belongs to: ``kvcached.core.manager`` -> ``core``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def group(p: str) -> str:
    """Parts that may import each other freely: the base is one, the top is one."""
    return "<base>" if p in BASE else "<top>" if p in TOP else p


def upward(edge: Import) -> bool:
    src, dst = part(edge.src), part(edge.dst)
    if src not in LEVEL or dst not in LEVEL:
        return True  # a new part of the package must be placed in LAYERS first
    return group(src) != group(dst) and LEVEL[dst] >= LEVEL[src]


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# ---------------------------------------------------------------------- tests
def test_every_part_of_the_package_has_a_layer():
    parts = {part(m) for m in package_modules()}
    assert parts <= set(LEVEL), (
        f"place {sorted(parts - set(LEVEL))} in a layer of tests/test_layers.py")


def test_no_module_imports_a_higher_layer():
    bad = list(dict.fromkeys(str(e) for e in import_edges() if upward(e)))
    assert not bad, ("upward imports (layers, bottom to top: " + " -> ".join(LAYERS)
                     + "):\n" + "\n".join(bad))


def test_no_import_cycles():
    edges = import_edges()
    msgs = []
    for comp in cycles(edges):
        members = set(comp)
        inside = list(dict.fromkeys(str(e) for e in edges
                                    if e.src in members and e.dst in members))
        msgs.append("cycle among " + ", ".join(comp) + ":\n  " + "\n  ".join(inside))
    assert not msgs, "\n".join(msgs)


# The checker itself, on made-up edges: the rules above are only as good as it is.
def test_upward_and_sideways_imports_are_caught():
    def edge(src, dst):
        return Import(f"kvcached.{src}", f"kvcached.{dst}", "x.py", 1)

    assert upward(edge("core.manager", "ops.logs"))
    assert upward(edge("memory.cuda_ipc", "copy.cuda"))  # siblings
    assert upward(edge("tasks", "transfer.base"))
    assert not upward(edge("core.manager", "transfer.base"))
    assert not upward(edge("config", "layout"))  # within the base
    assert not upward(edge("tools.demo", "ops.logs"))  # within the top
    assert not upward(edge("storage.blockstore", "storage.backends"))


def test_cycles_are_found_through_lazy_imports():
    def edge(src, dst):
        return Import(src, dst, "x.py", 1)

    found = cycles([edge("a", "b"), edge("b", "c"), edge("c", "a"), edge("c", "d")])
    assert found == [["a", "b", "c"]]
    assert cycles([edge("a", "b"), edge("b", "c")]) == []


def test_from_imports_resolve_to_submodules_or_their_package():
    mods = {"kvcached": None, "kvcached.storage": None, "kvcached.storage.backends": None,
            "kvcached.cuda_lib": None}
    tree = ast.parse("from kvcached import cuda_lib\n"
                     "from kvcached.storage import open_backend\n"
                     "from . import backends\n")
    got = [_targets(n, "kvcached.storage.blockstore", False, mods) for n in tree.body]
    assert got == [["kvcached.cuda_lib"], ["kvcached.storage"], ["kvcached.storage.backends"]]
