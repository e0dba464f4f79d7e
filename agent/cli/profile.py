"""`memplan profile`: build a Hugging Face architecture from config (random weights) and profile it to a Trace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.cli.common import bytes_option, console, err_console, write_json

if TYPE_CHECKING:
    import torch


def profile(
    model: Annotated[
        str, typer.Option("--model", help="architecture: gpt2, llama, mistral, qwen2 or gpt_neox")
    ],
    layers: Annotated[int, typer.Option("--layers", min=1, help="number of transformer blocks")],
    hidden: Annotated[int, typer.Option("--hidden", min=1, help="hidden size")],
    batch: Annotated[int, typer.Option("--batch", min=1, help="micro-batch size")] = 4,
    seq: Annotated[int, typer.Option("--seq", min=1, help="sequence length")] = 128,
    output: Annotated[Path, typer.Option("-o", "--output", help="write the Trace JSON here")] = Path(
        "trace.json"
    ),
    heads: Annotated[int | None, typer.Option("--heads", help="attention heads (default hidden/64)")] = None,
    vocab: Annotated[int, typer.Option("--vocab", min=2, help="vocabulary size")] = 32000,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="parameter dtype: fp32, bf16 or fp16")] = "fp32",
    max_blocks: Annotated[
        int | None,
        typer.Option(
            "--max-blocks",
            min=1,
            help="profile only this many blocks and extrapolate (models larger than the device)",
        ),
    ] = None,
    device_memory: Annotated[
        str | None,
        typer.Option(
            "--device-memory", help="report this device capacity instead of the measured one, e.g. 24GiB"
        ),
    ] = None,
    no_allocation_trace: Annotated[
        bool, typer.Option("--no-allocation-trace", help="leave out the allocation trace")
    ] = False,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="timed repetitions (medians)")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="weight initialisation seed")] = 0,
    process_group: Annotated[
        bool,
        typer.Option(
            "--process-group",
            help="under torchrun, on every rank: join the launcher's process group (gloo on cpu, nccl on cuda) "
            "and measure its collectives; every rank profiles at once and rank 0 writes the job's multi-rank "
            "trace, the slowest rank's",
        ),
    ] = False,
) -> None:
    """Build MODEL from a transformers config (nothing downloaded), profile one training step, write the Trace."""
    # local import: torch, the profiler and transformers load when the command runs, not for `memplan --help`
    import torch
    import torch.distributed as dist

    from agent.profiler import BlockDetectionError, ProfilerInputError
    from agent.profiler import profile as run_profile
    from agent.testing.model_zoo import KINDS, build, sample_batch

    if model not in KINDS:
        raise typer.BadParameter(f"{model!r} is not one of {', '.join(KINDS)}", param_hint="--model")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(dtypes)}", param_hint="--dtype")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available on this machine", param_hint="--device")
    limit = bytes_option(device_memory)

    if process_group:
        dev = join_launcher_group(dev)
    try:
        try:
            net, config = build(model, layers, hidden, heads=heads, vocab=vocab, seq=seq, seed=seed)
            sample = sample_batch(config, batch, seq)
        except ValueError as exc:
            err_console.print(f"[red]model[/]: {exc}")
            raise typer.Exit(2) from exc
        net.to(dtype=dtypes[dtype])  # type: ignore[call-arg]  # nn.Module.to, in place
        if max_blocks is None:
            net.to(dev)  # type: ignore[arg-type]  # with --max-blocks the profiler moves only the profiled blocks
        try:
            trace = run_profile(
                net,
                sample,
                device=dev,
                allocation_trace=not no_allocation_trace,
                max_blocks=max_blocks,
                repeats=repeats,
                device_memory_limit=limit,
                process_group=dist.group.WORLD if process_group else None,
            )  # named as agent.wrap names it
        except (BlockDetectionError, ProfilerInputError) as exc:
            err_console.print(f"[red]profile[/]: {exc}")
            raise typer.Exit(2) from exc
        if process_group and dist.get_rank() != 0:
            return  # every rank holds the job's one trace (the slowest rank's): rank 0 writes it
        write_json(output, trace.model_dump_json())
        m = trace.measurements
        alloc = trace.allocation_trace
        console.print(
            f"{trace.model.name}: {len(trace.model.blocks)} blocks, {trace.model.parameter_count:,} parameters; "
            f"iteration {m.iteration_s * 1e3:.1f} ms, peak {m.peak_device_bytes / 2**20:.1f} MiB"
            + (f", {len(alloc.events):,} allocation events" if alloc is not None else "")
            + (" (extrapolated)" if m.extrapolated else "")
        )
        console.print(f"wrote {output}")
    finally:
        if process_group:
            dist.destroy_process_group()


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (or any env:// launcher) sets on every rank; `--process-group` joins the group they name."""


def join_launcher_group(device: torch.device) -> torch.device:
    """Join the process group the launcher's environment names (gloo on a CPU device; NCCL on CUDA, each rank
    on the device `LOCAL_RANK` names when `--device cuda` names none); returns the device to profile on."""
    # local import: torch loads when the command runs, not for `memplan --help`
    import torch
    import torch.distributed as dist

    missing = [v for v in LAUNCHER_VARIABLES if v not in os.environ]
    if missing:
        raise typer.BadParameter(
            f"needs the environment of a launcher such as torchrun ({', '.join(missing)} not set)",
            param_hint="--process-group",
        )
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device
