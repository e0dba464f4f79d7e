"""The body of `memplan demo` (agent/cli/demo.py): the un-managed baseline, the managed run under the
limit, and the tables that compare them."""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import typer
from rich.table import Table

from agent.measure import DevicePeakMeter
from agent.profiler.optimizer_probe import state_tensors
from agent.testing import model_zoo
from agent.wrapping import unwrap, wrap
from client.cli.common import bytes_option, console
from client.cli.render import plan_table
from client.contract import AllocationCategory
from client.units import format_bytes
from planner_service.embedded import EmbeddedServer
from planner_service.settings import get_settings


def run(
    server: str | None,
    layers: int,
    hidden: int,
    batch: int,
    seq: int,
    steps: int,
    device_memory: str | None,
    fraction: float,
    threads: int | None,
    reuse: bool,
) -> None:
    """Run the demo with `memplan demo`'s options (checked there)."""
    t_start = time.perf_counter()
    # Any: transformers' typing of `PreTrainedModel.to` refuses a torch.device
    device: Any = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with _compute_threads(threads, device):
        console.print(
            f"[bold]memplan demo[/]: llama, {layers} blocks, hidden {hidden}, batch {batch} x {seq} tokens, "
            f"{steps} steps per run on {device} ({torch.get_num_threads()} compute threads)"
        )
        base, config = model_zoo.build("llama", layers, hidden, seq=max(seq, 128))
        batches = [model_zoo.sample_batch(config, batch, seq, seed=i, device=device) for i in range(4)]

        console.print("1. un-managed baseline (plain PyTorch) ...")
        plain = copy.deepcopy(base).to(device)
        plain_opt = _adamw(plain)
        plain_losses, plain_peak, plain_iter = _train_plain(plain, plain_opt, batches, steps, device)
        del plain, plain_opt
        limit = bytes_option(device_memory) or int(plain_peak * fraction)
        console.print(
            f"   peak device memory {format_bytes(plain_peak)}, {plain_iter * 1e3:.0f} ms/iteration; "
            f"limit for the managed run: {format_bytes(limit)}"
        )

        service = _service(server)
        with service as url:
            if server is None:
                console.print(
                    f"   planner service: in-process at {url}, database {service.database} (the database "
                    "`memplan serve` uses in this environment: the demo's traces, plans and feedback stay "
                    "there; MEMPLAN_DATABASE_URL picks another)",
                    highlight=False,
                )
            console.print(f"2. agent.wrap: profile, upload to {url}, plan, apply ...")
            model = copy.deepcopy(base).to(device)
            run = wrap(
                model,
                _adamw(model),
                sample_batch=batches[0],
                server=url,
                device_memory=limit,
                feedback_steps=steps,
                reuse=reuse,
            )
            assert run.source is not None
            console.print(f"   {run.source.message}")
            if run.source.origin == "history":
                console.print("   (predictions below come from the trace of the run that made this plan)")
            console.print("3. managed training ...")
            managed_losses = _train(run.model, run.optimizer, batches, steps)
            report = run.report()
            unwrap(run)

        console.print(plan_table(run.plan, title=f"plan under {format_bytes(limit)}"))
        t = Table(title="predicted vs measured (managed run)")
        for col in ("quantity", "predicted", "measured", "error"):
            t.add_column(col, justify="right" if col != "quantity" else "left")
        for row in report.rows():
            t.add_row(*row)
        t.add_row("un-managed peak", "", format_bytes(plain_peak), "")
        t.add_row("un-managed iteration", "", f"{plain_iter * 1e3:.1f} ms", "")
        console.print(t)
        console.print(f"feedback: {report.feedback_to or 'not sent'}")
        if report.swap is not None:
            s = report.swap
            console.print(
                f"swap: {format_bytes(s.swapped_out_bytes)} copied out, {s.prefetched_blocks} block prefetches, "
                f"{s.late_fetches} late, {s.demand_fetches} on demand"
            )

        rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(managed_losses, plain_losses, strict=True)]
        lt = Table(title="loss curve: managed vs un-managed baseline")
        for col in ("step", "baseline", "managed", "rel. difference"):
            lt.add_column(col, justify="right")
        shown = sorted({0, 1, 2, steps // 2, steps - 2, steps - 1})
        for i in shown:
            lt.add_row(str(i), f"{plain_losses[i]:.6f}", f"{managed_losses[i]:.6f}", f"{rel[i]:.1e}")
        console.print(lt)
        agree = max(rel) <= 1e-5
        console.print(
            f"max relative loss difference over {steps} steps: {max(rel):.2e} "
            + ("[green](agrees within 1e-5)[/]" if agree else "[red](differs)[/]")
        )
        console.print(f"demo took {time.perf_counter() - t_start:.0f} s")
        if not agree:
            raise typer.Exit(1)


@contextmanager
def _compute_threads(threads: int | None, device: torch.device) -> Iterator[None]:
    """Torch's compute threads for the demo's runs, restored after. On CPU the in-process service (its solve
    worker) shares the cores with training: by default leave it one. (The host optimizer step now runs
    inline on CPU; on 2 cores --threads 1 and 2 both took 11 s.)"""
    if device.type == "cpu" and threads is None:
        threads = max(1, (os.cpu_count() or 2) - 1)
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)


def _adamw(model: Any) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _train(model: Any, opt: Any, batches: list[Any], steps: int) -> list[float]:
    torch.manual_seed(0)
    losses = []
    for i in range(steps):
        loss = _step(model, opt, batches[i % len(batches)])
        losses.append(loss.item())
    return losses


def _step(model: Any, opt: Any, batch: Any) -> torch.Tensor:
    """One training step, the same for the managed run and the baseline whose losses it is compared with.
    Returns the loss tensor: callers hold it until the next step, as a training loop does (it is in the
    metered step's peak on CUDA)."""
    loss: torch.Tensor = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _train_plain(
    model: Any, opt: Any, batches: list[Any], steps: int, device: Any
) -> tuple[list[float], int, float]:
    """The baseline: losses, peak device bytes of step 2 (profiler semantics), median iteration seconds."""
    torch.manual_seed(0)
    meter = DevicePeakMeter(device)
    losses, times = [], []
    peak = 0
    last = time.perf_counter()
    for i in range(steps):
        b = batches[i % len(batches)]
        if i == 2:
            state = [(p, AllocationCategory.param) for p in model.parameters()]
            state += [(b_, AllocationCategory.param) for b_ in model.buffers()]
            state += [(v, AllocationCategory.optimizer) for _, v in state_tensors(opt)]
            meter.start(state, b)
        loss = _step(model, opt, b)
        losses.append(loss.item())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if i == 2:
            peak = meter.stop()
        elif i > 2:
            times.append(now - last)
        last = time.perf_counter()
    return losses, peak, statistics.median(times)


def _service(server: str | None):  # type: ignore[no-untyped-def]
    """The given server, or the embedded default: the real app on a loopback port with SQLite."""
    if server:
        return nullcontext(server)
    return EmbeddedServer(get_settings())
