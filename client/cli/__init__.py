"""The `memplan` command line: a thin layer over the SDK, the solvers and the agent (imported lazily)."""
