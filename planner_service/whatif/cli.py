"""`memplan whatif` and `memplan hardware catalog`: what-if questions from the command line.

Registered on the main CLI by `register(app)` (memplan/cli.py). Light at import: torch, transformers and the
solver are imported when a command runs (the modelled trace and the calibration here, transformers in
`architecture.py`, the solver in `answer.py`), so `memplan --help` stays fast.

Why one module over 400 lines: `memplan whatif` is one command with many options (model, workload, hardware,
sweep, calibration, output), each parsed and checked here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from client import Client
from client.cli.common import ServerOpt, TokenOpt, server_url
from client.cli.files import TRACE, WrongFile, read_as
from client.contract import CatalogEntry, HardwareCatalog, OptimizerKind, SweepPoint, SweepRequest, Trace
from client.errors import MemplanError
from client.units import format_bytes, parse_bytes
from planner_service.whatif.answer import Answer, largest_batch, tokens_per_s_str
from planner_service.whatif.answer import answer as answer_one
from planner_service.whatif.architecture import ArchitectureError, config_from_flags, load_config
from planner_service.whatif.catalog import CatalogError, entry, load_catalog
from planner_service.whatif.interconnect import GroupNotModelled, in_group, modelled_group
from planner_service.whatif.retarget import retarget, source_entry

if TYPE_CHECKING:  # calibration.py imports torch (through roofline.py)
    from transformers import PretrainedConfig

    from planner_service.whatif.calibration import Calibration

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
    err_console.print(f"[red]{escape(message)}[/]")
    return typer.Exit(2)


def _read_trace(path: Path, option: str) -> Trace:
    """The Trace in `path`; else exit 2 saying what the file is instead (not JSON, a plan, which fields are
    invalid), in the words `memplan plans solve` and `traces upload` use for the same file."""
    try:
        return read_as(path, Trace, TRACE)
    except WrongFile as exc:
        raise _fail(f"{option}: {exc}") from None


def _catalog(files: list[Path] | None) -> dict:
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
    seq: Annotated[
        str | None,
        typer.Option(
            "--seq", help="sequence length (default: the trace's); with --sweep a comma-separated list"
        ),
    ] = None,
    batch: Annotated[
        str | None,
        typer.Option(
            "--batch",
            help="batch size, or 'max' for the largest that fits "
            "(default: the trace's); with --sweep a comma-separated list",
        ),
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
    sweep: Annotated[
        bool,
        typer.Option(
            "--sweep",
            help="run on the planner service: every --batch x --seq x "
            "--hardware x --host-memory (comma lists) solved on its workers, with "
            "a progress bar",
        ),
    ] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    calibrate_with: Annotated[
        list[Path] | None,
        typer.Option(
            "--calibrate-with",
            help="with --config/--family: a measured Trace JSON of this model (repeatable); "
            "the efficiency factors of each --hardware entry whose device took it are fitted to it",
        ),
    ] = None,
    world_size: Annotated[
        int,
        typer.Option(
            "--world-size",
            min=1,
            help="ranks of a sharded job on one node of this hardware (collectives from the catalogue's "
            "peer link; --host-memory is then the node's)",
        ),
    ] = 1,
    ranks_per_node: Annotated[
        int | None,
        typer.Option(
            "--ranks-per-node", min=1, help="default: --world-size (one node; several are not modelled)"
        ),
    ] = None,
) -> None:
    """Will it fit, which limit binds, how fast: a model (config or measured trace) on catalogued GPUs."""
    if dtype not in ("bf16", "fp16", "fp32"):
        raise _fail(f"--dtype: {dtype!r} is not one of bf16, fp16, fp32")
    seqs = _int_list(seq, "--seq") if seq is not None else None
    if seqs is not None and len(seqs) > 1 and not sweep:
        raise _fail("--seq: one value (a list of them needs --sweep)")
    seq_n = seqs[0] if seqs else None
    cat = _catalog(catalog)
    keys = [k.strip() for h in hardware for k in h.split(",") if k.strip()]
    if not keys:
        raise _fail("--hardware: give at least one catalogue key (see `memplan hardware catalog`)")
    try:
        entries = [entry(cat, k) for k in keys]
        for e in entries:
            modelled_group(e, world_size, ranks_per_node)  # refuses what it cannot model, before any work
    except CatalogError as exc:
        raise _fail(str(exc)) from None
    except GroupNotModelled as exc:
        raise _fail(f"--{str(exc).replace('_', '-')}") from None
    if sweep and world_size > 1:
        raise _fail("--world-size: not with --sweep yet (the service's sweeps plan one device)")

    def answer(t: Trace, e: CatalogEntry, **kw: Any) -> Answer:
        """`answer_one` for one rank of the job (`--world-size`; 1: the trace as it is)."""
        return answer_one(in_group(t, e, world_size, ranks_per_node, node_host_memory_bytes=host), e, **kw)

    try:
        hosts = [parse_bytes(h.strip()) for h in host_memory.split(",")] if host_memory is not None else None
    except ValueError as exc:
        raise _fail(f"--host-memory: {exc}") from None
    if hosts is not None and len(hosts) > 1 and not sweep:
        raise _fail("--host-memory: one value (a list of them needs --sweep)")
    host = hosts[0] if hosts else None
    given = [n for n, v in (("--config", config), ("--family", family), ("--trace", trace)) if v is not None]
    if len(given) != 1:
        raise _fail("give exactly one of --config, --family or --trace")
    if sweep:
        if config is None and family is None:
            raise _fail("--sweep: needs a model config (--config or --family)")
        if batch is None or seqs is None:
            raise _fail("--sweep: needs --batch and --seq (comma-separated lists)")
        cfg_json: dict[str, object] = _model_config(
            config, family, layers, hidden, heads, kv_heads, intermediate, vocab, max(seqs)
        ).to_dict()
        _run_sweep(
            cfg_json,
            keys,
            _int_list(batch, "--batch"),
            seqs,
            hosts,
            dtype,
            optimizer,
            time_limit,
            server,
            token,
            as_json,
        )
        return
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
        if calibrate_with:
            raise _fail(
                "--calibrate-with: for a model config (--config/--family); a retargeted trace is scaled"
            )
        if seq_n is not None or batch_n is not None:
            raise _fail("--seq/--batch: a measured trace keeps its own workload; re-profile to change it")
        measured = _read_trace(trace, "--trace")
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

    if seq_n is None:
        raise _fail("--seq: required with a model config")
    seq_len: int = seq_n
    if batch is None:
        raise _fail("--batch: required with a model config (a number or 'max')")
    # the measured traces first: a file that is no trace is said before the model config loads (seconds)
    calibration_traces = [_read_trace(f, "--calibrate-with") for f in calibrate_with or []]
    cfg = _model_config(config, family, layers, hidden, heads, kv_heads, intermediate, vocab, seq_len)
    try:
        opt = OptimizerKind(optimizer)
    except ValueError:
        raise _fail(f"--optimizer: {optimizer!r} is not one of adamw, adam, sgd") from None

    # local import: torch loads when a model is run, not for `memplan --help`
    from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on

    calibrations = _calibrations(cfg, calibration_traces, entries, dtype, exact)
    iterations: dict[int, object] = {}

    def answer_at(b: int, e: CatalogEntry) -> Answer:
        if b not in iterations:
            try:
                iterations[b] = iterate(cfg, ModelledWorkload(b, seq_len, dtype, opt), exact=exact)
            except (ArchitectureError, ValueError) as exc:
                raise _fail(str(exc)) from None
        return answer(
            trace_on(
                iterations[b],  # type: ignore[arg-type]
                e,
                host_memory_bytes=host,
                calibration=calibrations.get(e.key),
            ),
            e,
            host_memory_bytes=host,
            time_limit_s=time_limit,
        )

    if not want_max:
        assert batch_n is not None
        _print([answer_at(batch_n, e) for e in entries], as_json)
        return
    for e in entries:

        def at_batch(b: int, e: CatalogEntry = e) -> Answer:
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


def _int_list(text: str, option: str) -> list[int]:
    """Positive integers of a comma-separated option value; a clear error naming the option otherwise."""
    out = []
    for part in text.split(","):
        try:
            v = int(part.strip())
        except ValueError:
            raise _fail(f"{option}: {part.strip()!r} is not a number") from None
        if v < 1:
            raise _fail(f"{option}: must be at least 1, got {v}")
        out.append(v)
    return out


def _model_config(
    config: Path | None,
    family: str | None,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    kv_heads: int | None,
    intermediate: int | None,
    vocab: int,
    seq: int,
) -> PretrainedConfig:
    """The model's config: `--config`'s file, or one built from `--family` and its size flags (positions for at
    least `seq` tokens, and 2048); an unreadable or unbuildable one fails naming the option."""
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
    except ArchitectureError as exc:
        raise _fail(str(exc)) from None
    return cfg


def _run_sweep(
    cfg_json: dict[str, object],
    keys: list[str],
    batches: list[int],
    seqs: list[int],
    hosts: list[int] | None,
    dtype: str,
    optimizer: str,
    time_limit: float,
    server: str | None,
    token: str | None,
    as_json: bool,
) -> None:
    """POST the sweep, show a progress bar while its points are solved, then every point (paged)."""
    try:
        req = SweepRequest(
            config=cfg_json,
            hardware=keys,
            batch_sizes=batches,
            sequence_lengths=seqs,
            host_memory_bytes=hosts,
            dtype=dtype,
            optimizer=optimizer,
            time_limit_s=time_limit,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise _fail(f"--sweep: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    try:
        with Client(server_url(server), token=token) as c:
            sweep = c.create_sweep(req)
            with Progress(
                TextColumn("sweep {task.fields[id]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[states]}"),
                TimeElapsedColumn(),
                console=err_console,
                disable=as_json,
            ) as bar:
                task = bar.add_task("sweep", total=sweep.progress.total, id=sweep.id[:8], states="")
                progress = sweep.progress
                while True:
                    states = ", ".join(f"{k} {v}" for k, v in sorted(progress.by_status.items()))
                    bar.update(task, completed=progress.finished, states=states)
                    if progress.finished >= progress.total:
                        break
                    time.sleep(0.5)
                    progress = c.get_sweep(sweep.id, limit=1).progress
            points: list[SweepPoint] = []
            cursor: str | None = None
            while True:
                page = c.get_sweep(sweep.id, limit=500, cursor=cursor)
                points += page.points
                cursor = page.next_cursor
                if cursor is None:
                    break
    except MemplanError as exc:
        raise _fail(f"--sweep: {exc}") from None
    if as_json:
        print(json.dumps({"id": sweep.id, "points": [p.model_dump(mode="json") for p in points]}, indent=2))
        return
    t = Table(title=f"sweep {sweep.id}: {len(points)} points ({dtype}, plans kept on the service)")
    for col in ("hardware", "batch", "seq", "host", "fits", "tokens/s", "peak device", "peak host", "plan"):
        t.add_column(col)
    for p in points:
        t.add_row(
            p.hardware,
            str(p.batch_size),
            str(p.sequence_length),
            format_bytes(p.host_memory_bytes),
            "yes" if p.fits else "no" if p.fits is False else p.status,
            f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-",
            format_bytes(p.peak_device_bytes) if p.peak_device_bytes is not None else "-",
            format_bytes(p.peak_host_bytes) if p.peak_host_bytes is not None else "-",
            p.plan_id[:8],
        )
    console.print(t)


def _calibrations(
    cfg: object, traces: list[Trace], entries: list[CatalogEntry], dtype: str, exact: bool
) -> dict[str, Calibration]:
    """Each entry's calibration from the measured `traces` taken on its device (entries without one are left
    out: their answers say uncalibrated)."""
    if not traces:
        return {}
    # local import: torch and scipy load when a calibration runs, not for `memplan --help`
    from planner_service.whatif.calibrate import CalibrationError, calibrate, samples_from_config

    out: dict[str, Calibration] = {}
    for e in entries:
        try:
            samples = samples_from_config(cfg, traces, e, exact=exact)
            if samples:
                out[e.key] = calibrate(samples, e, dtype)
        except CalibrationError as exc:
            raise _fail(f"--calibrate-with: {exc}") from None
    if not out:
        err_console.print(
            "--calibrate-with: no trace was taken on a device of the --hardware entries "
            "(matched by device name); the answers are uncalibrated"
        )
    return out


def _calibration_str(a: Answer) -> str:
    if not a.calibrated:
        return "uncalibrated"
    of = f" of {', '.join(a.calibration_models)}" if a.calibration_models else ""
    return (
        f"calibrated on {a.calibration_traces} measured traces{of} (block times "
        f"{100 * (a.calibration_residual or 0.0):.0f}% RMS error)"
    )


def _print(answers: list, as_json: bool) -> None:
    if as_json:
        out = [a.to_json() for a in answers]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return
    a0 = answers[0]
    t = Table(title=f"what-if: batch {a0.batch} x seq {a0.seq}, {a0.dtype} ({a0.source})")
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
    console.print(
        "times: " + "; ".join(f"{a.hardware} {_calibration_str(a)}" for a in answers), soft_wrap=True
    )
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
