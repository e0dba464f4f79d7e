"""`memplan alloc`: allocation planner on MiniMalloc CSV files, and the caching-allocator comparison.

Heavy modules (numba, the solver) are imported inside the commands, so `memplan --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from client.cli.common import bytes_option, console, err_console
from client.cli.files import ALLOCATION_TRACE, TRACE, WrongFile, describe, identify, parse_as, read_json
from client.cli.render import plural
from client.contract import AllocationTrace, Trace
from client.units import format_bytes

app = typer.Typer(
    no_args_is_help=True,
    help="Static allocation planning (MiniMalloc CSV in/out) and caching-allocator simulation.",
)


@app.command()
def solve(
    input_csv: Annotated[Path, typer.Argument(help="MiniMalloc CSV: id,lower,upper,size")],
    output: Annotated[Path, typer.Option("-o", "--output", help="write id,lower,upper,size,offset here")],
    capacity: Annotated[
        str | None, typer.Option(help="fit under this many bytes, e.g. 1048576 or 1MiB")
    ] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", help="seconds for the whole solve")] = 10.0,
    alignment: Annotated[int, typer.Option(help="offset alignment in bytes (1: none)")] = 1,
    fit_only: Annotated[
        bool,
        typer.Option(
            "--fit-only",
            help="with --capacity: stop at the first fit "
            "(MiniMalloc's question) instead of minimising the arena",
        ),
    ] = False,
) -> None:
    """Place every buffer of IN.csv; print status, arena, lower bound and gap; write OUT.csv."""
    # local import: the allocation planner (numba, ortools) loads when the command runs, not for --help
    from planner_service.solver.allocation import (
        AllocationInputError,
        plan_buffers,
        read_minimalloc_csv,
        validate_placement,
        write_minimalloc_csv,
    )

    cap = bytes_option(capacity)
    try:
        if input_csv.read_bytes()[:64].lstrip()[:1] in (
            b"{",
            b"[",
        ):  # JSON where a CSV is wanted: say what it is
            raise WrongFile(
                f"{input_csv} is {describe(read_json(input_csv))}, not a MiniMalloc CSV (id,lower,upper,size)"
            )
        buffers = read_minimalloc_csv(input_csv)
        plan = plan_buffers(
            buffers,
            capacity_bytes=cap,
            alignment_bytes=alignment,
            time_limit_s=time_limit,
            minimize=not (fit_only and cap is not None),
        )
    except WrongFile as exc:
        err_console.print(f"[red]error[/]: {exc}", highlight=False)
        raise typer.Exit(2) from exc
    except (AllocationInputError, OSError) as exc:
        err_console.print(f"[red]{input_csv}[/]: {exc}")
        raise typer.Exit(2) from exc
    console.print(f"buffers       {len(buffers)}")
    console.print(f"lower bound   {plan.lower_bound_bytes} B ({format_bytes(plan.lower_bound_bytes)})")
    if plan.status.value == "infeasible":
        console.print(f"[red]infeasible[/]: capacity {cap} B is below the {plan.proven_bound_bytes} B needed")
        raise typer.Exit(1)
    validate_placement(
        buffers, plan.offsets, capacity=cap if plan.status.value != "unknown" else None, alignment=alignment
    )
    write_minimalloc_csv(output, buffers, plan.offsets)
    console.print(f"arena         {plan.arena_bytes} B ({format_bytes(plan.arena_bytes)})")
    console.print(f"gap           {plan.gap:.2%}")
    console.print(f"status        {plan.status.value} ({plan.method}, {plan.solve_s:.2f} s)")
    console.print(f"wrote         {output}")
    if plan.status.value == "unknown":
        err_console.print(f"[yellow]no placement under {cap} B found in {time_limit} s[/]")
        raise typer.Exit(1)


@app.command()
def simulate(
    trace_json: Annotated[
        Path, typer.Argument(help="a Trace (with allocation_trace) or an AllocationTrace, JSON")
    ],
    time_limit: Annotated[float, typer.Option("--time-limit", help="seconds for the plan")] = 10.0,
    alignment: Annotated[int, typer.Option(help="offset alignment in bytes")] = 512,
    iterations: Annotated[int, typer.Option(help="iterations replayed back to back")] = 2,
) -> None:
    """Print PyTorch's caching allocator figures on TRACE.json beside the planned arena's."""
    # local import: the allocation planner (numba, ortools) loads when the command runs, not for --help
    from planner_service.solver.allocation import (
        plan_allocation,
        simulate_caching_allocator,
        validate_allocation,
    )

    try:
        data = read_json(trace_json)
        if identify(data) is TRACE:
            alloc = parse_as(trace_json, data, Trace, TRACE).allocation_trace
            if alloc is None:
                raise WrongFile(
                    f"{trace_json}: its allocation_trace is null (profile without --no-allocation-trace)"
                )
        else:
            alloc = parse_as(trace_json, data, AllocationTrace, ALLOCATION_TRACE)
    except WrongFile as exc:
        err_console.print(f"[red]error[/]: {exc}", highlight=False)
        raise typer.Exit(2) from exc
    plan = plan_allocation(alloc, alignment_bytes=alignment, time_limit_s=time_limit)
    validate_allocation(alloc, plan)
    sim = simulate_caching_allocator(alloc, iterations=iterations)
    table = Table(title=f"{trace_json.name}: {plural(len(alloc.events), 'buffer')}, horizon {alloc.horizon}")
    table.add_column("")
    table.add_column("planned arena", justify="right")
    table.add_column("caching allocator", justify="right")
    table.add_row(
        "lower bound (live bytes)", format_bytes(plan.lower_bound_bytes), format_bytes(plan.lower_bound_bytes)
    )
    table.add_row("peak reserved", format_bytes(plan.arena_bytes), format_bytes(sim.peak_reserved_bytes))
    table.add_row(
        "peak allocated", format_bytes(plan.lower_bound_bytes), format_bytes(sim.peak_allocated_bytes)
    )
    plan_frag = 0.0 if plan.arena_bytes == 0 else 1 - plan.lower_bound_bytes / plan.arena_bytes
    table.add_row(
        "fragmentation (1 - allocated/reserved)", f"{plan_frag:.2%}", f"{sim.fragmentation_ratio:.2%}"
    )
    table.add_row(
        "over lower bound",
        f"{plan.gap:.2%}",
        f"{sim.peak_reserved_bytes / max(plan.lower_bound_bytes, 1) - 1:.2%}",
    )
    table.add_row(
        "segments (small/large)",
        "1 arena",
        f"{sim.segments_allocated} ({sim.small_segments_allocated}/{sim.large_segments_allocated})",
    )
    table.add_row(
        "status",
        f"{plan.status.value} ({plan.solve_s:.2f} s)",
        "out of memory" if sim.out_of_memory else "ok",
    )
    console.print(table)
