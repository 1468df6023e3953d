"""The import graph of ``sglang_sparse`` has no cycle and respects the layer order.

Static (``ast``, nothing is imported): every ``import`` / ``from ... import`` anywhere in a module
counts -- at module level, under ``if TYPE_CHECKING:`` and inside functions alike -- resolved to
the package's own modules (relative imports included; ``from .x import y`` also counts ``.x.y`` when
that is a module; a package's ``__init__`` is a module of its own, named after the package).
Imports of anything else (numpy, sglang, C extensions without a ``.py`` file) are ignored.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "sglang_sparse"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: lowest first: a layer imports nothing from the layers after it
LAYERS = ("placement", "tree", "policy", "sim", "sglang_adapter")


@dataclass(frozen=True)
class Edge:
    """``src`` imports ``dst`` (dotted module names) at ``line`` of ``src``'s file."""

    src: str
    dst: str
    line: int


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (``__init__`` -> package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Dotted names an import statement may refer to (filtered to known modules by the caller)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        # ``from . import`` in a package's ``__init__`` is the package itself; in a module, its parent
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return [name] + [f"{name}.{alias.name}" for alias in node.names]


def import_edges(root: Path = ROOT) -> list[Edge]:
    """Every import of a package module by a package module (self-imports dropped), in file order."""
    mods = _modules(root)
    edges = []
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for dst in _targets(module, is_package, node):
                    if dst in mods and dst != module:
                        edges.append(Edge(module, dst, node.lineno))
    return edges


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """``graph[src][dst]`` = the first line of ``src`` importing ``dst``; every module is a key."""
    graph: dict[str, dict[str, int]] = {m: {} for m in _modules(root)}
    for e in import_edges(root):
        graph[e.src].setdefault(e.dst, e.line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph`` (iterative depth-first search), or ``None``."""
    state: dict[str, int] = {}  # absent: unvisited, 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_walker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Relative, ``TYPE_CHECKING`` and function-local imports are all edges; a cycle through them is
    found (a synthetic package, so this does not depend on the real one's imports)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import B\nclass A: ...\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import numpy\ndef f():\n    from .. import a\n")
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.sub.b": 3},
        "pkg.sub": {},
        "pkg.sub.b": {"pkg": 3, "pkg.a": 3},
    }
    assert find_cycle(graph) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg", "pkg.a", "pkg.sub.b", "pkg"])


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        steps = [
            f"  {a} -> {b}  ({_modules()[a].relative_to(ROOT.parent)}:{graph[a][b]})"
            for a, b in zip(cycle, cycle[1:], strict=False)
        ]
        raise AssertionError("import cycle:\n" + "\n".join(steps))


def test_layer_order() -> None:
    """placement < tree < policy < sim < sglang_adapter: no module imports from a later layer."""
    bad = [
        f"{e.src} -> {e.dst} (line {e.line})"
        for e in import_edges()
        if (lo := _layer(e.src)) is not None and (hi := _layer(e.dst)) is not None and hi > lo
    ]
    assert not bad, "layer order violated:\n" + "\n".join(bad)


#: The most lines a module of the package may have. SGLang's ``mem_cache/radix_cache.py``, the
#: tree the guide names as read in one sitting, has 832; 1,200 leaves that room plus a half for
#: docstrings that state invariants and units. A module that grows past it is split by purpose.
MAX_MODULE_LINES = 1200


def module_lines(root: Path = ROOT) -> dict[str, int]:
    """Dotted module name -> its line count."""
    return {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in _modules(root).items()}


def oversized(lines: dict[str, int], limit: int = MAX_MODULE_LINES) -> list[str]:
    """``"module: N lines"`` for every module over ``limit``, largest first."""
    return [f"{m}: {n} lines" for m, n in sorted(lines.items(), key=lambda kv: -kv[1]) if n > limit]


def test_size_check_names_what_is_too_long() -> None:
    assert oversized({"a": 10, "b": 1300, "c": 1201}, limit=1200) == ["b: 1300 lines", "c: 1201 lines"]


def test_no_module_over_the_size_limit() -> None:
    assert oversized(module_lines()) == [], f"split these by purpose (limit {MAX_MODULE_LINES})"
