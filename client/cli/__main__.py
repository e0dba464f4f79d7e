"""`python -m client.cli` runs the `memplan` command."""

from client.cli.main import app

app()
