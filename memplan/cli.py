"""Entry point of the `memplan` command: assembles each package's commands into one typer app.

`client.cli` holds the commands that only talk HTTP (and the shared console, size options and renderings);
`planner_service.cli` the ones that run the service or a solver in this process; `agent.cli` the ones that run
the agent on a model. Heavy imports (torch, ortools, fastapi) stay inside the commands, so `memplan --help`
starts fast.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pydantic
import typer
from rich.markup import escape

from agent.cli import demo, profile
from client.cli import remote
from client.cli.common import err_console
from client.errors import first_problem
from planner_service.cli import alloc, service, solve
from planner_service.whatif import cli as whatif_cli


class _App(typer.Typer):
    """The command line: an error a command did not turn into its own message (a value the contract refuses, a
    file that cannot be written, a malformed URL) is one line on stderr and exit status 1, not a traceback
    (session 19 probe); MEMPLAN_DEBUG=1 shows the traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the last word of the command line
            if os.environ.get("MEMPLAN_DEBUG"):
                raise
            err_console.print(f"[red]error[/]: {describe(exc)}", highlight=False, markup=True)
            sys.exit(1)


def describe(exc: Exception) -> str:
    """One line for an error: a validation error names its first field."""
    if isinstance(exc, pydantic.ValidationError):
        more = f" ({exc.error_count()} problems)" if exc.error_count() > 1 else ""
        return escape(first_problem(exc, exc.title) + more)
    return escape(f"{type(exc).__name__}: {exc}") + " (MEMPLAN_DEBUG=1 shows the traceback)"


app = _App(no_args_is_help=True, help="memplan: plan GPU memory for LLM training.")

plans_app = typer.Typer(no_args_is_help=True, help="Request, inspect and solve plans.")
plans_app.command("request")(remote.plans_request)
plans_app.command("get")(remote.plans_get)
plans_app.command("list")(remote.plans_list)
plans_app.command("solve")(solve.solve)

app.command("serve")(service.serve)
app.command("worker")(service.worker)
app.add_typer(service.db_app, name="db")
app.add_typer(service.tokens_app, name="tokens")
app.add_typer(remote.traces_app, name="traces")
app.add_typer(plans_app, name="plans")
app.add_typer(plans_app, name="plan", hidden=True)  # `memplan plan solve` reads naturally too
app.command("models")(remote.models)
app.add_typer(alloc.app, name="alloc")
app.command("profile")(profile.profile)
app.command("demo")(demo.demo)
whatif_cli.register(app)  # `memplan whatif`, `memplan hardware catalog` (planner_service/whatif/cli.py)
whatif_cli.hardware_app.command("list")(remote.hardware)


@whatif_cli.hardware_app.callback(invoke_without_command=True)
def hardware(
    ctx: typer.Context,
    as_json: remote.JsonOpt = False,
    server: remote.ServerOpt = None,
    token: remote.TokenOpt = None,
) -> None:
    """Hardware: without a subcommand, the machines the service has traces from (as `hardware list`)."""
    if ctx.invoked_subcommand is None:
        remote.hardware(as_json=as_json, server=server, token=token)
