"""`memplan plan solve`: solve a Trace file in-process (the same function the service's plan jobs call)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from client.cli.common import bytes_option, console, err_console, write_json
from client.cli.files import TRACE, WrongFile, read_as
from client.cli.render import plan_table
from client.contract import Constraints, SolverStatus, Trace


def solve(
    trace_json: Annotated[Path, typer.Argument(help="a Trace, JSON (from `memplan profile` or the agent)")],
    device_memory: Annotated[str, typer.Option("--device-memory", help="device memory limit, e.g. 24GiB")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write the Plan JSON here")] = None,
    host_memory: Annotated[
        str | None, typer.Option("--host-memory", help="host memory limit (default: trace's)")
    ] = None,
    pinned_memory: Annotated[
        str | None, typer.Option("--pinned-memory", help="pinned (page-locked) limit")
    ] = None,
    solver: Annotated[str, typer.Option("--solver", help="cpsat (default) or protrain")] = "cpsat",
    time_limit: Annotated[float, typer.Option("--time-limit", help="seconds for the whole solve")] = 10.0,
    seed: Annotated[int, typer.Option("--seed", help="solver random seed (fixed seed: same plan)")] = 0,
) -> None:
    """Solve TRACE.json for the fastest memory policy that fits; print its summary and write PLAN.json."""
    # local import: the solver (ortools) loads when the command runs, not for `memplan --help`
    from planner_service.solver import solve as solve_plan

    try:
        trace = read_as(trace_json, Trace, TRACE)
    except WrongFile as exc:
        err_console.print(f"[red]error[/]: {exc}", highlight=False)
        raise typer.Exit(2) from exc
    device_bytes = bytes_option(device_memory)
    assert device_bytes is not None  # a required option
    try:
        constraints = Constraints(
            device_memory_bytes=device_bytes,
            host_memory_bytes=bytes_option(host_memory),
            pinned_memory_bytes=bytes_option(pinned_memory),
            time_limit_s=time_limit,
        )
    except ValidationError as exc:
        err_console.print(f"[red]limits[/]: {exc}")
        raise typer.Exit(2) from exc
    try:
        plan = solve_plan(trace, constraints, solver=solver, seed=seed)
    except ValueError as exc:
        err_console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from exc
    console.print(plan_table(plan, title=f"{trace.model.name} on {trace.hardware.device_name}"))
    if plan.policy is not None:
        p = plan.policy
        persistent = ", ".join(str(i) for i in p.persistent_chunks) or "none"
        console.print(f"[bold]persistent chunks[/] {persistent}")
    if output is not None:
        write_json(output, plan.model_dump_json(indent=2))
        console.print(f"wrote {output}")
    if plan.solver.status == SolverStatus.infeasible:
        raise typer.Exit(1)
