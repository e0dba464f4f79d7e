"""No import cycle inside `agent/` (module-level, function-level and TYPE_CHECKING imports alike).

Before the runtime split, `runtime/manager.py` <-> `runtime/optimizer.py` and `feedback.py` <-> `wrapping.py`
imported each other. Edges to the package `__init__`s (`agent`, `agent.runtime`) are left out: they
re-export, and every submodule import passes through them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"agent", "agent.runtime", "agent.profiler", "agent.allocator"}


def _graph() -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    for path in (ROOT / "agent").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agent"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("agent"))
        modules[name] = deps
    return {
        m: {d for d in deps if d in modules and d != m and d not in PACKAGES} for m, deps in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_agent_package_has_no_import_cycle() -> None:
    graph = _graph()
    assert "agent.runtime.manager" in graph and "agent.feedback" in graph  # the walk found the tree
    assert _cycles(graph) == []
