"""`memplan profile`: profile a Hugging Face architecture built from config. (Built by 'Agent profiler'.)"""

import typer


def profile() -> None:
    raise typer.Exit("memplan profile: NOT BUILT YET (issue 'Agent profiler')")
