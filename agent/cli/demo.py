"""`memplan demo`: the whole loop on a real model: profile -> plan (service) -> apply -> train -> measure -> feedback.

By default the planner service runs in-process on a loopback port with SQLite (`--server` uses another
one). The demo builds a small llama-style model from config (random weights, nothing downloaded), trains
an un-managed baseline copy for `--steps` steps while measuring its peak device memory, then calls
`agent.wrap` under a device-memory limit (default: 45% of that peak, which makes the planner offload
chunks and checkpoint or swap blocks), trains the same steps on the same batches, and prints the plan,
predicted vs measured iteration time and peak memory (the agent posts the same figures to the service as
feedback), and how closely the managed loss curve follows the baseline's.

This module is the command (its options); the runs are in `demo_run.py`, which loads torch, the agent and
the service, imported when the command runs so that `memplan --help` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from client.cli.common import ServerOpt


def demo(
    server: ServerOpt = None,
    layers: Annotated[int, typer.Option(help="decoder blocks")] = 6,
    hidden: Annotated[int, typer.Option(help="hidden size")] = 128,
    batch: Annotated[int, typer.Option(help="batch size")] = 4,
    seq: Annotated[int, typer.Option(help="sequence length")] = 128,
    steps: Annotated[int, typer.Option(help="training steps of each run (baseline and managed)")] = 30,
    device_memory: Annotated[
        str | None, typer.Option(help="device-memory limit (default: 45% of the measured un-managed peak)")
    ] = None,
    fraction: Annotated[float, typer.Option(help="limit as a fraction of the un-managed peak")] = 0.45,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch compute threads (default on CPU: cores - 1, leaving one to the in-process service)"
        ),
    ] = None,
    reuse: Annotated[
        bool,
        typer.Option(
            help="reuse a plan from the service's history for this model, hardware and workload (its "
            "predictions then come from the earlier run's trace)"
        ),
    ] = False,
) -> None:
    """Train a small llama under a tight memory limit with a plan from the service; compare with plain PyTorch."""
    if steps < 6:
        raise typer.BadParameter("steps: at least 6 (2 warm-up, 1 metered, timed steps)")
    # local import: torch, the agent and the service load when the demo runs, not for `memplan --help`
    from agent.cli.demo_run import run

    run(server, layers, hidden, batch, seq, steps, device_memory, fraction, threads, reuse)
