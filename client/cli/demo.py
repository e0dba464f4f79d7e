"""`memplan demo`: the main job on the embedded default (in-process service on SQLite, real model, real profile).

Issue 'Foundation' stage: profile a llama-style model built from config, upload the trace, request a plan
under a device-memory limit that forces the planner to work, wait for it and show it. (The runtime
issues extend this to train under the plan and compare predictions with measurements.)
"""

from __future__ import annotations

from typing import Annotated

import typer

from client.cli.common import ServerOpt, bytes_option, console
from client.cli.render import plan_table
from client.units import format_bytes


def demo(server: ServerOpt = None,
         layers: Annotated[int, typer.Option(help="decoder blocks")] = 8,
         hidden: Annotated[int, typer.Option(help="hidden size")] = 256,
         batch: Annotated[int, typer.Option(help="batch size")] = 4,
         seq: Annotated[int, typer.Option(help="sequence length")] = 128,
         device_memory: Annotated[str | None, typer.Option(
             help="device-memory limit (default: 45% of the measured un-managed peak)")] = None) -> None:
    """Profile a small llama, plan it under a tight memory limit on the embedded service, show the plan."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    import agent
    from agent import model_zoo
    from client.contract import Constraints
    from client.sdk import Client

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(f"building llama ({layers} layers, hidden {hidden}) from config", total=None)
        model, config = model_zoo.build("llama", layers, hidden, seq=max(seq, 128))
        sample = model_zoo.sample_batch(config, batch, seq)
        bar.update(task, description="profiling one training iteration")
        trace = agent.profile(model, sample)
        peak = trace.measurements.peak_device_bytes
        limit = bytes_option(device_memory) or int(peak * 0.45)
        constraints = Constraints(device_memory_bytes=limit, time_limit_s=10.0)
        with _service(server) as url, Client(url) as c:
            bar.update(task, description=f"uploading trace to {url}")
            created = c.upload_trace(trace)
            record = c.request_plan(created.id, constraints)
            bar.update(task, description=f"solving plan {record.id[:12]} under {format_bytes(limit)}")
            record = c.wait_for_plan(record.id, timeout_s=120)
        bar.update(task, description="done")
    console.print(f"trace {created.id[:12]}: {trace.model.name}, {len(trace.model.repeated_blocks)} blocks, "
                  f"{trace.model.parameter_count / 1e6:.1f} M parameters, un-managed peak {format_bytes(peak)}, "
                  f"iteration {trace.measurements.iteration_s * 1e3:.0f} ms on {trace.hardware.device_name}")
    console.print(f"plan {record.id[:12]}: {record.status}" + (" (reused from history)" if record.reused else ""))
    if record.plan is not None:
        console.print(plan_table(record.plan, title=f"plan under {format_bytes(limit)}"))
    if record.status not in ("done", "infeasible"):
        raise typer.Exit(1)


def _service(server: str | None):  # type: ignore[no-untyped-def]
    """The given server, or the embedded default: the real app on a loopback port with SQLite."""
    from contextlib import nullcontext

    if server:
        return nullcontext(server)
    from client.cli.embedded import EmbeddedServer
    from planner_service.settings import get_settings

    return EmbeddedServer(get_settings())
