"""Entry point of the `memplan` command: registers each area's commands (heavy imports stay inside them)."""

from __future__ import annotations

import typer

from client.cli import alloc, demo, policy, profile, remote, service
from planner_service.whatif import cli as whatif_cli

app = typer.Typer(no_args_is_help=True, help="memplan: plan GPU memory for LLM training.")

plans_app = typer.Typer(no_args_is_help=True, help="Request, inspect and solve plans.")
plans_app.command("request")(remote.plans_request)
plans_app.command("get")(remote.plans_get)
plans_app.command("list")(remote.plans_list)
plans_app.command("solve")(policy.solve)

app.command("serve")(service.serve)
app.command("worker")(service.worker)
app.add_typer(service.db_app, name="db")
app.add_typer(service.tokens_app, name="tokens")
app.add_typer(remote.traces_app, name="traces")
app.add_typer(plans_app, name="plans")
app.add_typer(plans_app, name="plan", hidden=True)  # `memplan plan solve` reads naturally too
app.add_typer(alloc.app, name="alloc")
app.command("profile")(profile.profile)
app.command("demo")(demo.demo)
whatif_cli.register(app)  # `memplan whatif`, `memplan hardware catalog` (planner_service/whatif/cli.py)
