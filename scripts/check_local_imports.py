"""Every import inside a function body says why it is not at the module top (issue 18).

An import in a function hides a dependency from whoever reads the module's head. One is kept only for a
reason: keeping `import agent` and `memplan --help` light (torch, ortools, sqlalchemy, fastapi loaded only
by the commands that run them), an optional dependency (numba, transformers, playwright), a CUDA-only module.
Such an import carries a comment in this fixed form, on its own line or in the comment lines just above it:

    import torch  # local import: `memplan --help` does not load torch

    # local import: transformers is optional (the `models` extra)
    import transformers

A comment just above the first of a run of consecutive import statements (blank lines aside) covers the
run. A bare one fails the check. Typing-only imports go under `if TYPE_CHECKING:` at the module top instead.

Usage: python scripts/check_local_imports.py [--count] [ROOT]
  --count   print every function-level import (bare or with its reason) per file and the totals; exit 0.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("agent", "client", "planner_service", "memplan")
REASON = re.compile(r"#\s*local import:\s*\S")


@dataclass(frozen=True)
class LocalImport:
    path: str
    line: int
    text: str
    reason: bool


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (tokenize: a `#` inside a string is not a comment)."""
    found: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string
    return found


def _standalone(lines: list[str], line: int) -> bool:
    """Whether 1-based `line` holds only a comment (so it may explain the import below it)."""
    return 1 <= line <= len(lines) and lines[line - 1].lstrip().startswith("#")


def _run_heads(tree: ast.AST) -> dict[int, ast.stmt]:
    """id(import) -> the first import of the run of consecutive import statements it belongs to."""
    heads: dict[int, ast.stmt] = {}
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            head: ast.stmt | None = None
            for stmt in statements:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    head = head or stmt
                    heads[id(stmt)] = head
                else:
                    head = None
    return heads


def local_imports(path: Path, relative: str) -> list[LocalImport]:
    source = path.read_text()
    lines = source.splitlines()
    comments = _comments(source)
    tree = ast.parse(source, filename=relative)
    heads = _run_heads(tree)

    def explained_above(node: ast.stmt) -> bool:
        """A reason in the block of comment lines just above `node` (a reason may run over several lines)."""
        above = node.lineno - 1
        while _standalone(lines, above):
            if REASON.search(comments.get(above, "")):
                return True
            above -= 1
        return False

    seen: set[int] = set()  # an import in a nested function is walked from each enclosing function
    found: list[LocalImport] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in seen:
                continue
            seen.add(id(node))
            end = node.end_lineno or node.lineno
            own = any(REASON.search(comments.get(n, "")) for n in range(node.lineno, end + 1))
            reason = own or explained_above(node) or explained_above(heads.get(id(node), node))
            found.append(LocalImport(relative, node.lineno, lines[node.lineno - 1].strip(), reason))
    return sorted(found, key=lambda i: i.line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true", help="list every function-level import and exit 0")
    parser.add_argument("root", nargs="?", default=".", type=Path)
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()

    imports: list[LocalImport] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            imports.extend(local_imports(path, path.relative_to(root).as_posix()))

    if args.count:
        per_file = Counter(i.path for i in imports)
        bare_per_file = Counter(i.path for i in imports if not i.reason)
        for name in sorted(per_file):
            print(f"{per_file[name]:4d} {name} ({bare_per_file[name]} bare)")
        print(f"{len(imports)} function-level imports, {sum(bare_per_file.values())} without a reason")
        return 0

    problems = [
        f"{i.path}:{i.line}: import inside a function without a reason: {i.text}\n"
        "    move it to the module top, or say why on its line: `# local import: <reason>`"
        for i in imports
        if not i.reason
    ]
    for problem in problems:
        print(problem, file=sys.stderr)
    with_reason = sum(1 for i in imports if i.reason)
    print(f"local imports: {len(imports)} in functions, {with_reason} with a reason")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
