"""`memplan serve`, `memplan worker`, `memplan db ...`: run and administer the planner service.

The service's modules (FastAPI, SQLAlchemy, pydantic-settings, the solver) are imported inside the commands,
so `memplan --help` stays fast.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from client.cli.common import console, err_console

db_app = typer.Typer(no_args_is_help=True, help="Database schema (Alembic migrations).")
tokens_app = typer.Typer(no_args_is_help=True, help="API tokens (each scoped to one project).")
DbUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="MEMPLAN_DATABASE_URL",
        help="SQLAlchemy URL (default: SQLite under the user's data dir)",
    ),
]


def _settings(database_url: str | None, **kw: object):  # type: ignore[no-untyped-def]
    # local import: pydantic-settings loads when the command runs, not for `memplan --help`
    from planner_service.settings import Settings

    values = {k: v for k, v in kw.items() if v is not None}
    if database_url:
        values["database_url"] = database_url
    return Settings(**values)  # type: ignore[arg-type]


def serve(
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port", envvar="MEMPLAN_PORT")] = 8000,
    workers: Annotated[int | None, typer.Option(help="in-process solve workers (0: external only)")] = None,
    database_url: DbUrlOpt = None,
    processes: Annotated[
        int,
        typer.Option(help="API processes (each with its own workers); >1 needs a database other than SQLite"),
    ] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Run the planner service (API + in-process workers)."""
    # local import: uvicorn and the service load when the command runs, not for `memplan --help`
    import uvicorn

    from planner_service.app import InsecureBind, check_bind, create_app
    from planner_service.observability import configure_logging

    settings = _settings(database_url, workers=workers)
    try:
        check_bind(host, settings)
    except InsecureBind as exc:
        err_console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from exc
    configure_logging(log_level.upper())
    console.print(
        f"memplan serving on http://{host}:{port} (database: {_redact(settings.database_url)}; "
        "`memplan demo` without --server uses the same one in this environment)",
        highlight=False,
    )
    if processes > 1:
        if settings.is_sqlite:
            err_console.print("[red]--processes > 1 needs PostgreSQL[/] (SQLite allows one writer process)")
            raise typer.Exit(2)
        # the factory reads its settings from the environment: pass on what the options changed
        os.environ["MEMPLAN_DATABASE_URL"] = settings.database_url
        os.environ["MEMPLAN_WORKERS"] = str(settings.workers)
        # each API process dies with this one, even after a kill -9 (planner_service.lifeline)
        os.environ["MEMPLAN_LIFELINE_PARENT"] = str(os.getpid())
        uvicorn.run(
            "planner_service.app:app_from_env",
            factory=True,
            host=host,
            port=port,
            workers=processes,
            log_level=log_level,
            access_log=False,
        )
        return
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, access_log=False)


def _redact(url: str) -> str:
    """Hide a password in a database URL before printing it."""
    # local import: SQLAlchemy loads when the command runs, not for `memplan --help`
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def worker(
    database_url: DbUrlOpt = None,
    concurrency: Annotated[int, typer.Option(help="plans solved at once by this worker")] = 1,
    once: Annotated[bool, typer.Option(help="solve what is queued now, then exit")] = False,
) -> None:
    """Run a solve worker (procrastinate) against the service's PostgreSQL database: run many, on any machine."""
    # local import: the service and its job queue load when the command runs, not for `memplan --help`
    from planner_service.app import prepare_database
    from planner_service.jobs.engine import EngineWorker
    from planner_service.observability import configure_logging

    configure_logging()
    settings = _settings(database_url)
    if settings.is_sqlite:
        err_console.print(
            "[red]`memplan worker` needs PostgreSQL[/]: on SQLite `memplan serve` solves plans in "
            "its own process (--workers N)"
        )
        raise typer.Exit(2)
    db = prepare_database(settings)
    try:  # SIGINT/SIGTERM: procrastinate stops fetching and lets running solves finish
        EngineWorker(db, settings, concurrency).run(wait=not once)
    except KeyboardInterrupt:
        pass
    finally:
        db.dispose()


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="target revision")] = "head", database_url: DbUrlOpt = None
) -> None:
    """Apply migrations up to REVISION (default head)."""
    # local import: Alembic and SQLAlchemy load when the command runs, not for `memplan --help`
    from planner_service.db.migrate import upgrade

    settings = _settings(database_url)
    upgrade(settings.database_url, revision)
    console.print(f"schema upgraded to {revision}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="target revision, e.g. -1 or base")] = "-1",
    database_url: DbUrlOpt = None,
) -> None:
    """Revert migrations down to REVISION."""
    # local import: Alembic and SQLAlchemy load when the command runs, not for `memplan --help`
    from planner_service.db.migrate import downgrade

    settings = _settings(database_url)
    downgrade(settings.database_url, revision)
    console.print(f"schema downgraded to {revision}")


@db_app.command("current")
def db_current(database_url: DbUrlOpt = None) -> None:
    """Show the schema revision of the database and the code's head."""
    # local import: Alembic and SQLAlchemy load when the command runs, not for `memplan --help`
    from planner_service.db.migrate import current_revision, head_revision
    from planner_service.db.session import Database

    settings = _settings(database_url)
    db = Database(settings.database_url)
    console.print(f"database: {current_revision(db.engine) or '(empty)'}  code head: {head_revision()}")
    db.dispose()


@tokens_app.command("create")
def tokens_create(
    project: Annotated[str, typer.Option(help="project the token may see and write")],
    name: Annotated[str, typer.Option(help="label for listings")] = "",
    database_url: DbUrlOpt = None,
) -> None:
    """Create a token for PROJECT (created if missing); the token is printed once and stored only hashed."""
    # local import: the service's database layer loads when the command runs, not for `memplan --help`
    from planner_service.app import prepare_database
    from planner_service.auth import create_token

    db = prepare_database(_settings(database_url))
    with db.session() as s:
        token, row = create_token(s, project, name)
        token_id = row.id
    db.dispose()
    console.print(f"token id {token_id} for project {project!r} (shown once, store it safely):")
    print(token)


@tokens_app.command("revoke")
def tokens_revoke(token_id: str, database_url: DbUrlOpt = None) -> None:
    """Revoke a token by id."""
    # local import: the service's database layer loads when the command runs, not for `memplan --help`
    from planner_service.app import prepare_database
    from planner_service.auth import revoke_token

    db = prepare_database(_settings(database_url))
    with db.session() as s:
        ok = revoke_token(s, token_id)
    db.dispose()
    if not ok:
        err_console.print(f"[red]no active token {token_id}[/]")
        raise typer.Exit(1)
    console.print(f"revoked {token_id}")
