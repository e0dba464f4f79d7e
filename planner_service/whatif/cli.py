"""`memplan whatif` and `memplan hardware catalog`: what-if questions from the command line.

Registered on the main CLI by `register(app)` (one line in client/cli/main.py). Light at import: torch,
transformers and the solver are imported when a command runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from client.units import format_bytes, parse_bytes

console = Console()
err_console = Console(stderr=True)
hardware_app = typer.Typer(
    help="Hardware: the service's machines (`memplan hardware`, `hardware list`) and the catalogue "
    "used by what-if planning (`hardware catalog`)."
)

CatalogOpt = Annotated[
    list[Path] | None,
    typer.Option("--catalog", help="a catalogue file of extra entries (repeatable; also MEMPLAN_CATALOG)"),
]


def register(app: typer.Typer) -> None:
    """Add `whatif` and the `hardware` group (its `catalog` command) to the main `memplan` app."""
    app.command("whatif")(whatif)
    app.add_typer(hardware_app, name="hardware")


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[red]{message}[/]")
    return typer.Exit(2)


def _catalog(files: list[Path] | None) -> dict:
    from planner_service.whatif.catalog import CatalogError, load_catalog

    try:
        return load_catalog(files or [])
    except CatalogError as exc:
        raise _fail(str(exc)) from None


@hardware_app.command("catalog")
def catalog_command(
    as_json: Annotated[bool, typer.Option("--json", help="print the entries as JSON")] = False,
    catalog: CatalogOpt = None,
) -> None:
    """List the catalogued accelerators (shipped entries plus yours)."""
    entries = _catalog(catalog)
    if as_json:
        from client.contract import HardwareCatalog

        print(HardwareCatalog(entries=list(entries.values())).model_dump_json(indent=2))
        return
    t = Table(title="hardware catalogue (dense peak; sustained host copies)")
    for col in (
        "key",
        "device",
        "memory",
        "bandwidth",
        "bf16",
        "fp32",
        "host link",
        "h2d",
        "host RAM",
        "cores",
    ):
        t.add_column(col)
    for e in entries.values():
        link = e.host_link
        link_s = (
            f"PCIe {link.pcie_generation} x{link.lanes}" if link.kind.value == "pcie" else link.kind.value
        )
        t.add_row(
            e.key,
            e.name,
            format_bytes(e.device_memory_bytes),
            f"{e.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s",
            f"{e.dense_flops.bf16 / 1e12:,.0f} TF",
            f"{e.dense_flops.fp32 / 1e12:,.1f} TF",
            link_s,
            f"{link.h2d_bytes_per_s / 1e9:,.1f} GB/s",
            format_bytes(e.host_memory_bytes),
            str(e.cpu_cores),
        )
    console.print(t)


def whatif(
    hardware: Annotated[
        list[str],
        typer.Option(
            "--hardware",
            help="catalogue key(s): repeat the option or separate with commas, e.g. a100-80gb-sxm,h100-sxm",
        ),
    ],
    seq: Annotated[int | None, typer.Option("--seq", help="sequence length (default: the trace's)")] = None,
    batch: Annotated[
        str | None,
        typer.Option("--batch", help="batch size, or 'max' for the largest that fits (default: the trace's)"),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="a Hugging Face config.json (or its folder)")
    ] = None,
    family: Annotated[
        str | None, typer.Option("--family", help="instead of --config: a model_type, e.g. llama")
    ] = None,
    layers: Annotated[int | None, typer.Option("--layers", help="with --family: repeated blocks")] = None,
    hidden: Annotated[int | None, typer.Option("--hidden", help="with --family: width")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="with --family: attention heads")] = None,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", help="with --family: key/value heads")] = None,
    intermediate: Annotated[
        int | None, typer.Option("--intermediate", help="with --family: MLP width")
    ] = None,
    vocab: Annotated[int, typer.Option("--vocab", help="with --family: vocabulary size")] = 32000,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace", help="instead of a config: retarget this measured Trace JSON to each --hardware"
        ),
    ] = None,
    source: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="with --trace: the catalogue key it was measured on (default: matched by device name)",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="bf16, fp16 or fp32 (configs only)")] = "bf16",
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="adamw, adam or sgd (configs only)")
    ] = "adamw",
    host_memory: Annotated[
        str | None,
        typer.Option("--host-memory", help="host memory, e.g. 384GiB (default: the entry's typical host)"),
    ] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", help="solver seconds per question")] = 2.0,
    exact: Annotated[
        bool, typer.Option("--exact", help="run every block on fake tensors (default: 3, extrapolated)")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the answer(s) as JSON")] = False,
    catalog: CatalogOpt = None,
) -> None:
    """Will it fit, which limit binds, how fast: a model (config or measured trace) on catalogued GPUs."""
    from client.contract import OptimizerKind, Trace
    from planner_service.whatif.answer import Answer, answer, largest_batch
    from planner_service.whatif.architecture import ArchitectureError, config_from_flags, load_config
    from planner_service.whatif.catalog import CatalogError, entry
    from planner_service.whatif.retarget import retarget, source_entry

    if dtype not in ("bf16", "fp16", "fp32"):
        raise _fail(f"--dtype: {dtype!r} is not one of bf16, fp16, fp32")
    if seq is not None and seq < 1:
        raise _fail(f"--seq: must be at least 1, got {seq}")
    cat = _catalog(catalog)
    keys = [k.strip() for h in hardware for k in h.split(",") if k.strip()]
    if not keys:
        raise _fail("--hardware: give at least one catalogue key (see `memplan hardware catalog`)")
    try:
        entries = [entry(cat, k) for k in keys]
    except CatalogError as exc:
        raise _fail(str(exc)) from None
    try:
        host = parse_bytes(host_memory) if host_memory is not None else None
    except ValueError as exc:
        raise _fail(f"--host-memory: {exc}") from None
    given = [n for n, v in (("--config", config), ("--family", family), ("--trace", trace)) if v is not None]
    if len(given) != 1:
        raise _fail("give exactly one of --config, --family or --trace")
    want_max = batch is not None and batch.strip().lower() == "max"
    batch_n: int | None = None
    if batch is not None and not want_max:
        try:
            batch_n = int(batch)
        except ValueError:
            raise _fail(f"--batch: {batch!r} is not a number or 'max'") from None
        if batch_n < 1:
            raise _fail(f"--batch: must be at least 1, got {batch_n}")

    results: list[dict[str, object]] = []
    if trace is not None:
        if want_max:
            raise _fail("--batch max: needs a model config (a measured trace is for one batch)")
        if seq is not None or batch_n is not None:
            raise _fail("--seq/--batch: a measured trace keeps its own workload; re-profile to change it")
        try:
            measured = Trace.model_validate_json(trace.read_text())
        except OSError as exc:
            raise _fail(f"--trace {trace}: cannot read ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise _fail(f"--trace {trace}: not a valid Trace: {str(exc).splitlines()[0]}") from None
        try:
            src = entry(cat, source) if source is not None else source_entry(measured, cat)
        except CatalogError as exc:
            raise _fail(str(exc)) from None
        answers = [
            answer(
                retarget(measured, src, e, host_memory_bytes=host),
                e,
                host_memory_bytes=host,
                time_limit_s=time_limit,
            )
            for e in entries
        ]
        _print(answers, as_json)
        return

    if seq is None:
        raise _fail("--seq: required with a model config")
    if batch is None:
        raise _fail("--batch: required with a model config (a number or 'max')")
    try:
        if config is not None:
            cfg = load_config(config)
        else:
            if layers is None or hidden is None:
                raise _fail("--family: needs --layers and --hidden")
            cfg = config_from_flags(
                family or "",
                layers=layers,
                hidden=hidden,
                heads=heads,
                kv_heads=kv_heads,
                intermediate=intermediate,
                vocab=vocab,
                max_positions=max(seq, 2048),
            )
        opt = OptimizerKind(optimizer)
    except ArchitectureError as exc:
        raise _fail(str(exc)) from None
    except ValueError:
        raise _fail(f"--optimizer: {optimizer!r} is not one of adamw, adam, sgd") from None

    from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on  # imports torch

    iterations: dict[int, object] = {}

    def answer_at(b: int, e: object) -> Answer:
        if b not in iterations:
            try:
                iterations[b] = iterate(cfg, ModelledWorkload(b, seq, dtype, opt), exact=exact)
            except (ArchitectureError, ValueError) as exc:
                raise _fail(str(exc)) from None
        return answer(
            trace_on(iterations[b], e, host_memory_bytes=host),  # type: ignore[arg-type]
            e,  # type: ignore[arg-type]
            host_memory_bytes=host,
            time_limit_s=time_limit,
        )

    if not want_max:
        assert batch_n is not None
        _print([answer_at(batch_n, e) for e in entries], as_json)
        return
    for e in entries:

        def at_batch(b: int, e: object = e) -> Answer:
            return answer_at(b, e)

        search = largest_batch(at_batch)
        results.append(
            {
                "hardware": e.key,
                "largest_batch": search.largest.batch if search.largest else None,
                "largest": search.largest.to_json() if search.largest else None,
                "tried": [
                    {"batch": a.batch, "fits": a.fits, "tokens_per_s": a.tokens_per_s, "binding": a.binding}
                    for a in search.tried
                ],
            }
        )
    if as_json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
        return
    for r in results:
        t = Table(title=f"--batch max on {r['hardware']}: largest batch that fits: {r['largest_batch']}")
        for col in ("batch", "fits", "tokens/s", "binds"):
            t.add_column(col)
        for row in r["tried"]:  # type: ignore[attr-defined]
            tps = row["tokens_per_s"]
            t.add_row(
                str(row["batch"]),
                "yes" if row["fits"] else "no",
                f"{tps:,.0f}" if tps else "-",
                row["binding"] or "-",
            )
        console.print(t)


def _print(answers: list, as_json: bool) -> None:
    from planner_service.whatif.answer import tokens_per_s_str

    if as_json:
        out = [a.to_json() for a in answers]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return
    a0 = answers[0]
    t = Table(
        title=f"what-if: batch {a0.batch} x seq {a0.seq}, {a0.dtype} ({a0.source}, "
        f"{'calibrated' if a0.calibrated else 'uncalibrated'})"
    )
    for col in (
        "hardware",
        "fits",
        "binds",
        "peak device",
        "peak host",
        "iteration",
        "tokens/s",
        "un-managed peak",
        "needs",
    ):
        t.add_column(col)
    for a in answers:
        needs = "-"
        if a.min_device_memory_bytes is not None:
            needs = f"device >= {format_bytes(a.min_device_memory_bytes)}"
        if a.min_host_memory_bytes is not None:
            needs = f"host >= {format_bytes(a.min_host_memory_bytes)}"
        t.add_row(
            a.hardware,
            "yes" if a.fits else "no",
            a.binding or "-",
            format_bytes(a.peak_device_bytes) if a.peak_device_bytes is not None else "-",
            format_bytes(a.peak_host_bytes) if a.peak_host_bytes is not None else "-",
            f"{a.iteration_s:.3f} s" if a.iteration_s is not None else "-",
            tokens_per_s_str(a),
            format_bytes(a.unmanaged_peak_device_bytes),
            needs,
        )
    console.print(t)
    if len(answers) == 1 and a0.plan_summary:
        s = a0.plan_summary
        if "block_modes" in s:
            console.print(
                f"plan: {s['offloaded_chunks']} of {s['chunks']} chunks of "
                f"{format_bytes(int(s['chunk_size_bytes']))} offloaded through {s['n_buffers']} buffers; "
                f"blocks {s['block_modes']} (K keep, C checkpoint, S swap); solver {a0.solver_status}"
            )
        else:
            console.print(f"solver {a0.solver_status}: {s.get('message', '')}")
