"""`memplan alloc`: allocation planner on MiniMalloc CSV files. (Built by the issue 'Allocation planner'.)"""

import typer

app = typer.Typer(help="Static allocation planning (MiniMalloc CSV in/out) and caching-allocator simulation.")


@app.command()
def solve() -> None:
    raise typer.Exit("memplan alloc solve: NOT BUILT YET (issue 'Allocation planner')")
