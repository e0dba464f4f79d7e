"""The `memplan` commands that run the agent on a model in this process: `profile`, `demo` (registered by
`memplan.cli`)."""
