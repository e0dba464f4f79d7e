"""Helpers shared by the CLI commands: byte-size options, the console, server URL resolution."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from client.units import parse_bytes

console = Console()
err_console = Console(
    stderr=True, soft_wrap=True
)  # errors are not cut into lines: paths stay whole for copying


def bytes_option(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


ServerOpt = Annotated[
    str | None,
    typer.Option("--server", envvar="MEMPLAN_SERVER", help="planner service URL, e.g. http://127.0.0.1:8000"),
]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="MEMPLAN_TOKEN", help="API token")]


def server_url(server: str | None) -> str:
    url = server or os.environ.get("MEMPLAN_SERVER")
    if not url:
        err_console.print("[red]no server[/]: pass --server URL or set MEMPLAN_SERVER")
        raise typer.Exit(2)
    return url


def write_json(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # never leave a half-written file behind
