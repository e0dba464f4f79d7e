"""`python -m memplan` runs the `memplan` command."""

from memplan.cli import app

app()
