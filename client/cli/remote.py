"""`memplan traces ...` and `memplan plans request|get|list`: talk to a planner service through the SDK."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated

import typer

from client.cli.common import ServerOpt, TokenOpt, bytes_option, console, err_console, server_url, write_json
from client.cli.render import plan_table, plans_table
from client.contract import Constraints, Trace
from client.errors import MemplanError
from client.sdk import Client

traces_app = typer.Typer(no_args_is_help=True, help="Upload and browse traces.")


def _client(server: str | None, token: str | None) -> Client:
    return Client(server_url(server), token=token)


def _fail(exc: MemplanError) -> typer.Exit:
    err_console.print(f"[red]error[/]: {exc}")
    return typer.Exit(1)


@traces_app.command("upload")
def traces_upload(file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="trace JSON")],
                  server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Upload a trace (gzip-compressed on the wire); prints its id."""
    try:
        trace = Trace.model_validate_json(file.read_bytes())
    except ValueError as exc:
        err_console.print(f"[red]{file} is not a valid trace[/]:\n{exc}")
        raise typer.Exit(1) from exc
    try:
        with _client(server, token) as c:
            created = c.upload_trace(trace)
    except MemplanError as exc:
        raise _fail(exc) from exc
    console.print(f"{created.id}  ({'new' if created.created else 'already stored'}, sha256 {created.content_hash[:12]})")


@traces_app.command("get")
def traces_get(trace_id: str, output: Annotated[Path | None, typer.Option("-o", "--output")] = None,
               server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Fetch a trace; writes it to --output or prints a summary."""
    try:
        with _client(server, token) as c:
            record = c.get_trace(trace_id)
    except MemplanError as exc:
        raise _fail(exc) from exc
    if output:
        write_json(output, record.trace.model_dump_json(indent=1))
        console.print(f"wrote {output}")
    else:
        console.print(f"{record.id} {record.model_name} on {record.hardware_key} ({record.workload_key})")


@traces_app.command("list")
def traces_list(model: Annotated[str | None, typer.Option(help="model name or fingerprint")] = None,
                hardware: Annotated[str | None, typer.Option(help="hardware key")] = None,
                limit: Annotated[int, typer.Option(help="most rows to show")] = 50,
                server: ServerOpt = None, token: TokenOpt = None) -> None:
    """List traces, newest first."""
    try:
        with _client(server, token) as c:
            rows = list(itertools.islice(c.list_traces(model=model, hardware=hardware), limit))
    except MemplanError as exc:
        raise _fail(exc) from exc
    for r in rows:
        console.print(f"{r.id}  {r.created_at:%Y-%m-%d %H:%M:%S}  {r.model_name}  {r.hardware_key}  {r.workload_key}")


def plans_request(trace_id: str,
                  device_memory: Annotated[str, typer.Option(help="device memory limit, e.g. 24GiB")],
                  host_memory: Annotated[str | None, typer.Option(help="host memory limit, e.g. 256GiB")] = None,
                  time_limit: Annotated[float, typer.Option(help="solver time limit, seconds")] = 10.0,
                  solver: Annotated[str, typer.Option(help="cpsat or protrain")] = "cpsat",
                  wait: Annotated[bool, typer.Option(help="wait for the result")] = False,
                  server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Request a plan for an uploaded trace."""
    constraints = Constraints(device_memory_bytes=bytes_option(device_memory),  # type: ignore[arg-type]
                              host_memory_bytes=bytes_option(host_memory), time_limit_s=time_limit)
    try:
        with _client(server, token) as c:
            record = c.request_plan(trace_id, constraints, solver=solver)
            console.print(f"{record.id}  {record.status}{' (reused)' if record.reused else ''}")
            if wait:
                record = c.wait_for_plan(record.id)
    except MemplanError as exc:
        raise _fail(exc) from exc
    if wait:
        _show(record)


def _show(record) -> None:  # type: ignore[no-untyped-def]
    console.print(f"plan {record.id}: {record.status}" + (f" ({record.error})" if record.error else ""))
    if record.plan is not None:
        console.print(plan_table(record.plan))


def plans_get(plan_id: str, wait: Annotated[bool, typer.Option(help="long-poll until finished")] = False,
              output: Annotated[Path | None, typer.Option("-o", "--output", help="write the Plan JSON")] = None,
              server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Show a plan (optionally wait for it)."""
    try:
        with _client(server, token) as c:
            record = c.wait_for_plan(plan_id) if wait else c.get_plan(plan_id)
    except MemplanError as exc:
        raise _fail(exc) from exc
    _show(record)
    if output and record.plan is not None:
        write_json(output, record.plan.model_dump_json(indent=1))
        console.print(f"wrote {output}")


def plans_list(model: Annotated[str | None, typer.Option(help="model name or fingerprint")] = None,
               hardware: Annotated[str | None, typer.Option(help="hardware key")] = None,
               status: Annotated[str | None, typer.Option(help="queued|running|done|failed|infeasible")] = None,
               limit: Annotated[int, typer.Option(help="most rows to show")] = 50,
               server: ServerOpt = None, token: TokenOpt = None) -> None:
    """List plans, newest first."""
    try:
        with _client(server, token) as c:
            rows = list(itertools.islice(c.list_plans(model=model, hardware=hardware, status=status), limit))
    except MemplanError as exc:
        raise _fail(exc) from exc
    console.print(plans_table(rows))
