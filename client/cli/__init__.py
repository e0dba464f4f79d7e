"""The `memplan` commands that only talk HTTP to a planner service through the SDK (traces, plans request/get/list,
models, hardware), and the helpers every command shares (`common`, `render`). Imports neither `agent` nor
`planner_service`; `memplan.cli` assembles the whole command."""
