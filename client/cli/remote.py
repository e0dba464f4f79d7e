"""`memplan traces ...`, `memplan plans request|get|list`, `memplan models`, `memplan hardware`: talk to a planner
service through the SDK. Ids may be typed short (any unique prefix); lists take `--json`."""

from __future__ import annotations

import heapq
import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.markup import escape
from rich.table import Table

from client.cli.common import ServerOpt, TokenOpt, bytes_option, console, err_console, server_url, write_json
from client.cli.files import TRACE, WrongFile, read_as
from client.cli.lookup import (
    LookupFailed,
    match_hardware,
    match_model,
    resolve_plan_id,
    resolve_trace_id,
)
from client.cli.render import (
    feedback_table,
    hardware_table,
    models_table,
    plan_table,
    plans_table,
    traces_table,
)
from client.contract import Constraints, PlanRecord, PlanStatus, Trace, TraceSummary
from client.errors import APIConnectionError, MemplanError, NotFoundError, service_root
from client.sdk import Client

traces_app = typer.Typer(no_args_is_help=True, help="Upload and browse traces.")

ModelFilterOpt = Annotated[
    str | None, typer.Option(help="model name (exact, prefix or substring) or fingerprint")
]
HardwareFilterOpt = Annotated[str | None, typer.Option(help="hardware key (exact, prefix or substring)")]
WorldSizeOpt = Annotated[
    int | None, typer.Option(min=1, help="only jobs of this many ranks (1: single-process jobs)")
]
RanksPerNodeOpt = Annotated[int | None, typer.Option(min=1, help="only jobs with this many ranks per node")]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="print the rows as a JSON array (whole ids) instead of a table")
]
LimitOpt = Annotated[int, typer.Option(min=1, help="most rows to show")]
Row = TypeVar("Row", bound=BaseModel)


def _client(server: str | None, token: str | None) -> Client:
    return Client(server_url(server), token=token)


def _fail(exc: Exception, server: str | None = None) -> typer.Exit:
    """Exit 1 with `exc` on stderr; for a call to the service, what to change when the URL is the fault.
    `server`: the --server given (None: MEMPLAN_SERVER)."""
    err_console.print(f"[red]error[/]: {escape(str(exc))}{_url_hint(exc, server)}", highlight=False)
    return typer.Exit(1)


def _url_hint(exc: Exception, server: str | None) -> str:
    if not isinstance(exc, (APIConnectionError, NotFoundError)):
        return ""
    url = server or os.environ.get("MEMPLAN_SERVER", "")
    if isinstance(exc, APIConnectionError):
        return f" (server {url}, from --server or MEMPLAN_SERVER)"
    if exc.no_such_route:
        return f"; no memplan API at {url}: give the service's root URL (e.g. {service_root(url)})"
    return ""


def _print_json(rows: Sequence[BaseModel]) -> None:
    # plain stdout, not rich: no wrapping or colour in what scripts read
    typer.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=1))


@traces_app.command("upload")
def traces_upload(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="trace JSON")],
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Upload a trace (gzip-compressed on the wire); prints its id."""
    try:
        trace = read_as(file, Trace, TRACE)
    except WrongFile as exc:
        raise _fail(exc) from exc
    try:
        with _client(server, token) as c:
            created = c.upload_trace(trace)
    except MemplanError as exc:
        raise _fail(exc, server) from exc
    console.print(
        f"{created.id}  ({'new' if created.created else 'already stored'}, sha256 {created.content_hash[:12]})"
    )


@traces_app.command("get")
def traces_get(
    trace_id: Annotated[str, typer.Argument(help="trace id, or a unique prefix of it")],
    output: Annotated[Path | None, typer.Option("-o", "--output")] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Fetch a trace; writes it to --output or prints a summary."""
    try:
        with _client(server, token) as c:
            record = c.get_trace(resolve_trace_id(c, trace_id))
    except (MemplanError, LookupFailed) as exc:
        raise _fail(exc, server) from exc
    if output:
        write_json(output, record.trace.model_dump_json(indent=1))
        console.print(f"wrote {output}")
    else:
        console.print(f"{record.id} {record.model_name} on {record.hardware_key} ({record.workload_key})")


def _filters(c: Client, model: str | None, hardware: str | None) -> tuple[list[dict[str, str | None]], str]:
    """API filter sets for what was typed (a name may stand for several), and a caption saying what matched."""
    models: Sequence[str | None] = [None]
    keys: Sequence[str | None] = [None]
    said = []
    if model is not None:
        matched = match_model(c.models(), model).values
        models = matched
        said.append(f"model {', '.join(matched)}")
    if hardware is not None:
        matched = match_hardware(c.hardware(), hardware).values
        keys = matched
        said.append(f"hardware {', '.join(matched)}")
    return [{"model": m, "hardware": h} for m, h in itertools.product(models, keys)], "; ".join(said)


def _group(world_size: int | None, ranks_per_node: int | None) -> dict[str, int]:
    """The process-group filters that were given (issue 20), as API parameters."""
    given = {"world_size": world_size, "ranks_per_node": ranks_per_node}
    return {k: v for k, v in given.items() if v is not None}


def _group_said(group: dict[str, int]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in group.items())


def _page(limit: int) -> int:
    """Rows per request: what the list shows, within the API's page limit."""
    return min(limit, 1000)


def _newest_first(streams: list[Iterator[Any]], limit: int) -> list[Any]:
    """The `limit` newest rows of several newest-first streams (each follows its own cursors, lazily)."""
    return _merged(streams, limit, newest_first=True)


def _merged(streams: list[Iterator[Any]], limit: int, *, newest_first: bool) -> list[Any]:
    """The first `limit` rows of several streams sorted by (created_at, id) the same way."""
    merged = heapq.merge(*streams, key=lambda r: (r.created_at, r.id), reverse=newest_first)
    return list(itertools.islice(merged, limit))


@traces_app.command("list")
def traces_list(
    model: ModelFilterOpt = None,
    hardware: HardwareFilterOpt = None,
    world_size: WorldSizeOpt = None,
    ranks_per_node: RanksPerNodeOpt = None,
    limit: LimitOpt = 50,
    as_json: JsonOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """List traces, newest first."""
    try:
        with _client(server, token) as c:
            filters, said = _filters(c, model, hardware)
            group = _group(world_size, ranks_per_node)
            rows: list[TraceSummary] = _newest_first(
                [c.list_traces(limit=_page(limit), **f, **group) for f in filters], limit
            )
            said = "; ".join(x for x in (said, _group_said(group)) if x)
    except (MemplanError, LookupFailed) as exc:
        raise _fail(exc, server) from exc
    if as_json:
        _print_json(rows)
    else:
        console.print(traces_table(rows, title="traces" + (f" ({said})" if said else "")))


def plans_request(
    trace_id: Annotated[str, typer.Argument(help="trace id, or a unique prefix of it")],
    device_memory: Annotated[str, typer.Option(help="device memory limit, e.g. 24GiB")],
    host_memory: Annotated[str | None, typer.Option(help="host memory limit, e.g. 256GiB")] = None,
    time_limit: Annotated[float, typer.Option(help="solver time limit, seconds")] = 10.0,
    solver: Annotated[str, typer.Option(help="cpsat or protrain")] = "cpsat",
    wait: Annotated[bool, typer.Option(help="wait for the result")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Request a plan for an uploaded trace."""
    constraints = Constraints(
        device_memory_bytes=bytes_option(device_memory),
        host_memory_bytes=bytes_option(host_memory),
        time_limit_s=time_limit,
    )
    try:
        with _client(server, token) as c:
            record = c.request_plan(resolve_trace_id(c, trace_id), constraints, solver=solver)
            console.print(f"{record.id}  {record.status}{' (reused)' if record.reused else ''}")
            if wait:
                record = c.wait_for_plan(record.id)
    except (MemplanError, LookupFailed) as exc:
        raise _fail(exc, server) from exc
    if wait:
        _show(record)


def _show(record: PlanRecord) -> None:
    console.print(
        f"plan {record.id}: {record.status}" + (f" ({record.error})" if record.error else ""), highlight=False
    )
    if record.plan is not None:
        console.print(plan_table(record.plan))
    if record.feedback:
        console.print(feedback_table(record))
    elif record.status is PlanStatus.done:
        console.print("feedback: none yet (the agent posts what it measured after applying the plan)")


def plans_get(
    plan_id: Annotated[str, typer.Argument(help="plan id, or a unique prefix of it")],
    wait: Annotated[bool, typer.Option(help="long-poll until finished")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write the Plan JSON")] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Show a plan, and the feedback measured while it was applied (optionally wait for it)."""
    try:
        with _client(server, token) as c:
            full = resolve_plan_id(c, plan_id)
            record = c.wait_for_plan(full) if wait else c.get_plan(full)
    except (MemplanError, LookupFailed) as exc:
        raise _fail(exc, server) from exc
    _show(record)
    if output and record.plan is not None:
        write_json(output, record.plan.model_dump_json(indent=1))
        console.print(f"wrote {output}")


PLAN_SORT_KEYS = (
    "created_at",
    "model",
    "hardware",
    "workload",
    "status",
    "solver",
    "iteration",
    "peak",
    "device_limit",
    "error",
    "peak_error",
)  # the API's `sort` keys (planner_service.db.repositories.PLAN_SORT_KEYS; checked by the service)


def plans_list(
    model: ModelFilterOpt = None,
    hardware: HardwareFilterOpt = None,
    status: Annotated[str | None, typer.Option(help="queued|running|done|failed|infeasible")] = None,
    search: Annotated[
        str | None,
        typer.Option(
            help="free text: every word found in the model name, hardware key, workload or a feedback "
            "note, or starting the plan id"
        ),
    ] = None,
    sort: Annotated[
        str,
        typer.Option(
            help="column to sort by: " + ", ".join(PLAN_SORT_KEYS) + "; '-' first for descending "
            "(--sort=-error: the largest measured error first); error is |measured / predicted - 1|",
        ),
    ] = "-created_at",
    world_size: WorldSizeOpt = None,
    ranks_per_node: RanksPerNodeOpt = None,
    limit: LimitOpt = 50,
    as_json: JsonOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """List plans, newest first unless --sort says otherwise (ids shown short: any unique prefix is accepted
    back). Filtering, searching and sorting are the service's (the same as GET /v1/plans and the UI)."""
    try:
        with _client(server, token) as c:
            filters, said = _filters(c, model, hardware)
            group = _group(world_size, ranks_per_node)
            streams = [
                c.list_plans(status=status, limit=_page(limit), sort=sort, search=search, **f, **group)
                for f in filters
            ]
            if len(streams) == 1:
                rows: list[PlanRecord] = list(itertools.islice(streams[0], limit))
            elif sort in ("-created_at", "created_at"):
                rows = _merged(streams, limit, newest_first=sort.startswith("-"))
            else:
                raise LookupFailed(
                    f"--sort {sort}: {said} matched several; give an exact name or key to sort by another "
                    "column than created_at"
                )
            said = "; ".join(x for x in (said, _group_said(group)) if x)
    except (MemplanError, LookupFailed) as exc:
        raise _fail(exc, server) from exc
    if as_json:
        _print_json(rows)
    else:
        caption = "; ".join(x for x in (said, f"search {search!r}" if search else "", f"sort {sort}") if x)
        console.print(plans_table(rows, title=f"plans ({caption})"))


def _catalogue(
    server: str | None,
    token: str | None,
    as_json: bool,
    fetch: Callable[[Client], list[Row]],
    table: Callable[[list[Row]], Table],
) -> None:
    """`memplan models` and `memplan hardware`: one catalogue call, printed as JSON or as its table."""
    try:
        with _client(server, token) as c:
            rows = fetch(c)
    except MemplanError as exc:
        raise _fail(exc, server) from exc
    if as_json:
        _print_json(rows)
    else:
        console.print(table(rows))


def models(as_json: JsonOpt = False, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """List the models the service has traces of (names and fingerprints for `--model`)."""
    _catalogue(server, token, as_json, Client.models, models_table)


def hardware(as_json: JsonOpt = False, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """List the hardware the service has traces from (keys for `--hardware`)."""
    _catalogue(server, token, as_json, Client.hardware, hardware_table)
