"""The `memplan` command's composition root: `memplan.cli.app` assembles the commands of `client.cli` (HTTP
only), `planner_service.cli` (service and solvers) and `agent.cli` (profile, demo). It is the one package that
imports all three; nothing imports it. `python -m memplan` runs the command. The library is `agent`, `client`
and `planner_service`: there is nothing else to import here."""
