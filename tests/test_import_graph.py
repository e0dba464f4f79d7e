"""No import cycle inside `agent/`, `client/`, `planner_service/` or `memplan/` (module-level, function-level
and TYPE_CHECKING imports alike).

Before the runtime split, `runtime/manager.py` <-> `runtime/optimizer.py` and `feedback.py` <-> `wrapping.py`
imported each other; `planner_service/db/migrate.py` <-> `db/session.py` did until the readiness probe moved
to `migrate.py`. Edges to the package `__init__`s (`agent`, `agent.runtime`, ...) are left out: they
re-export, and every submodule import passes through them. import-linter's contracts (.importlinter) check
the layers between packages; this checks the modules inside each.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("agent", "client", "planner_service", "memplan")


def _graph(top: str) -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    packages: set[str] = set()
    for path in (ROOT / top).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if path.name == "__init__.py":
            packages.add(name)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == top:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == top)
        modules[name] = deps
    return {
        m: {d for d in deps if d in modules and d != m and d not in packages} for m, deps in modules.items()
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


# One module of each package that the walk must find (a walk of an empty or moved tree would pass vacuously).
KNOWN = {
    "agent": ("agent.runtime.manager", "agent.feedback"),
    "client": ("client.sdk", "client.contract.plan"),
    "planner_service": ("planner_service.db.migrate", "planner_service.db.session"),
    "memplan": ("memplan.cli",),
}


@pytest.mark.parametrize("top", TOP_LEVEL)
def test_the_package_has_no_import_cycle(top: str) -> None:
    graph = _graph(top)
    assert all(m in graph for m in KNOWN[top])  # the walk found the tree
    assert _cycles(graph) == []
