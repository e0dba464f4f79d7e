"""`memplan plan solve`: solve a Trace file in-process. (Built by the issue 'Cost model and CP-SAT solver'.)"""

import typer


def solve() -> None:
    raise typer.Exit("memplan plan solve: NOT BUILT YET (issue 'Cost model and CP-SAT memory-policy solver')")
