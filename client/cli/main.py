"""Entry point of the `memplan` command: registers each area's commands (heavy imports stay inside them)."""

from __future__ import annotations

import typer

from client.cli import alloc, policy, profile

app = typer.Typer(no_args_is_help=True, help="memplan: plan GPU memory for LLM training.")
plans_app = typer.Typer(no_args_is_help=True, help="Request, inspect and solve plans.")
plans_app.command("solve")(policy.solve)
app.add_typer(plans_app, name="plans")
app.add_typer(plans_app, name="plan", hidden=True)
app.add_typer(alloc.app, name="alloc")
app.command("profile")(profile.profile)
