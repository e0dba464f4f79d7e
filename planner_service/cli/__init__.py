"""The `memplan` commands that run the service or its solvers in this process: serve, worker, db, tokens,
`plans solve`, `alloc` (registered by `memplan.cli`)."""
