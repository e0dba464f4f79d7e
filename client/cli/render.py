"""Rich renderings of plans, plan records, traces and the catalog for the terminal."""

from __future__ import annotations

from rich.table import Table

from client.cli.lookup import short_id
from client.contract import (
    FeedbackRecord,
    HardwareSummary,
    ModelSummary,
    Placement,
    Plan,
    PlanRecord,
    TraceSummary,
)
from client.units import format_bytes


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 buffer`, `2 buffers`."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def plan_table(plan: Plan, title: str = "plan") -> Table:
    t = Table(title=title, show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    s = plan.solver
    bound = f"{s.best_bound:.4f} s" if s.best_bound is not None else "-"
    gap = f"{s.gap:.2%}" if s.gap is not None else "-"
    t.add_row(
        "solver",
        f"{s.solver} {s.solver_version}: {s.status.value} in {s.solve_s:.2f} s (bound {bound}, gap {gap})",
    )
    if s.message:
        t.add_row("", s.message)
    c = plan.constraints
    host = (
        format_bytes(c.host_memory_bytes)
        if c.host_memory_bytes
        else "the machine's memory as the trace measured it"
    )
    t.add_row("limits", f"device {format_bytes(c.device_memory_bytes)}; host {host}")
    if s.min_device_memory_bytes is not None:
        t.add_row("fits from", format_bytes(s.min_device_memory_bytes))
    if plan.policy is not None:
        p = plan.policy
        persistent = sum(1 for ch in p.chunks if ch.placement == Placement.persistent)
        strip = "".join("P" if ch.placement == Placement.persistent else "o" for ch in p.chunks)
        t.add_row(
            "chunks",
            f"{plural(len(p.chunks), 'chunk')} of {format_bytes(p.chunk_size_bytes)}: {persistent} "
            f"persistent, {len(p.chunks) - persistent} offloaded, "
            f"{plural(p.n_buffers, 'device buffer')} for offloaded chunks",
        )
        t.add_row("chunk strip", f"{strip}  (P persistent, o offloaded)")
        if p.world_size > 1:  # issue 20: which chunks each rank holds only a share of
            sharded = "".join("s" if ch.sharded else "r" for ch in p.chunks)
            t.add_row(
                "ranks",
                f"planned for {p.world_size} ranks: {len(p.sharded_chunks)} of {len(p.chunks)} chunks sharded; "
                f"{sharded}  (s sharded, r replicated)",
            )
        t.add_row("block modes", f"{p.mode_strip()}  (K keep, C checkpoint, S swap)")
    if plan.predictions is not None:
        pr = plan.predictions
        t.add_row(
            "predicted",
            f"{pr.iteration_s * 1e3:.1f} ms/iter (fwd {pr.forward_s * 1e3:.1f}, bwd "
            f"{pr.backward_s * 1e3:.1f}, optim dev {pr.device_optimizer_s * 1e3:.1f} / host "
            f"{pr.host_optimizer_s * 1e3:.1f})",
        )
        t.add_row(
            "peak memory",
            f"device {format_bytes(pr.peak_device_bytes)}, host {format_bytes(pr.peak_host_bytes)}",
        )
    if plan.allocation is not None:
        a = plan.allocation
        # At solve time the service places the buffers of the profiled iteration (recorded without this plan's
        # offloading and recomputation); once the agent has run the plan, those of its managed iteration.
        placed = "this plan's iteration" if a.iteration == "managed" else "profiled (un-managed) iteration"
        t.add_row(
            "allocation",
            f"{placed}: arena {format_bytes(a.arena_bytes)} vs live-bytes "
            f"bound {format_bytes(a.lower_bound_bytes)} (gap {a.gap:.2%}, {a.status.value}, "
            f"{plural(len(a.offsets), 'buffer')} placed)",
        )
    return t


def feedback_table(record: PlanRecord) -> Table:
    """What the agent measured each time the plan was applied, against the plan's predictions."""
    t = Table(title=f"feedback ({plural(len(record.feedback), 'run')} measured)")
    cols = (
        "received",
        "steps",
        "iteration",
        "error",
        "by phase (error)",
        "peak device",
        "error",
        "peak host",
        "notes",
    )
    for col in cols:
        t.add_column(col, justify="left" if col in ("received", "by phase (error)", "notes") else "right")

    for f in record.feedback:
        fb = f.feedback
        t.add_row(
            f.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            str(fb.steps_measured),
            f"{fb.iteration_s * 1e3:.1f} ms",
            _signed_percent(f.iteration_error),
            phases_text(f),
            format_bytes(fb.peak_device_bytes),
            _signed_percent(f.peak_device_error),
            format_bytes(fb.peak_host_bytes),
            fb.notes or "",
        )
    return t


PHASE_NAMES = {"forward_s": "forward", "backward_s": "rest", "step_s": "step"}


def phases_text(record: FeedbackRecord) -> str:
    """'forward 12.3 ms (+4.0%), rest 30.1 ms (-2.0%), step 1.2 ms (+9.0%), uploads 11 (+0.0%)'; '-' when the
    feedback has no phases (an agent before they were measured)."""
    ph = record.feedback.phases
    if ph is None:
        return "-"
    errors = record.phase_errors or {}
    parts = [
        f"{name} {getattr(ph, k) * 1e3:.1f} ms ({_signed_percent(errors.get(k))})"
        for k, name in PHASE_NAMES.items()
    ]
    if ph.uploads_per_iteration is not None:
        parts.append(
            f"uploads {ph.uploads_per_iteration:g} ({_signed_percent(errors.get('uploads_per_iteration'))})"
        )
    return ", ".join(parts)


def _signed_percent(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def plans_table(records: list[PlanRecord], title: str = "plans") -> Table:
    t = Table(title=title)
    cols = (
        "id",
        "status",
        "model",
        "hardware",
        "device limit",
        "predicted",
        "error",
        "peak error",
        "created",
    )
    for col in cols:
        t.add_column(col, justify="right" if col in ("error", "peak error") else "left")
    for r in records:
        pred = r.headline.predictions if r.headline else None
        t.add_row(
            short_id(r.id),
            r.status,
            r.model_name,
            r.hardware_key,
            format_bytes(r.constraints.device_memory_bytes),
            f"{pred.iteration_s * 1e3:.1f} ms" if pred else "-",
            _signed_percent(r.iteration_error),
            _signed_percent(r.peak_device_error),
            r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    return t


def traces_table(rows: list[TraceSummary], title: str = "traces") -> Table:
    t = Table(title=title)
    for col in ("id", "model", "hardware", "workload", "created"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            short_id(r.id),
            r.model_name,
            r.hardware_key,
            r.workload_key,
            r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    return t


def models_table(rows: list[ModelSummary]) -> Table:
    t = Table(title="models (--model takes a name, a prefix or part of one, or a fingerprint)")
    for col in ("name", "fingerprint", "architecture", "parameters", "traces", "plans"):
        t.add_column(col, justify="right" if col in ("parameters", "traces", "plans") else "left")
    for m in rows:
        t.add_row(
            m.name,
            short_id(m.fingerprint),
            m.architecture,
            f"{m.parameter_count:,}",
            str(m.traces),
            str(m.plans),
        )
    return t


def hardware_table(rows: list[HardwareSummary]) -> Table:
    t = Table(title="hardware (--hardware takes a key, a prefix or part of one)")
    for col in ("key", "device", "memory per device", "devices", "traces", "plans"):
        t.add_column(
            col, justify="right" if col in ("memory per device", "devices", "traces", "plans") else "left"
        )
    for h in rows:
        t.add_row(
            h.key,
            f"{h.device_type} {h.device_name}",
            format_bytes(h.device_memory_bytes),
            str(h.device_count),
            str(h.traces),
            str(h.plans),
        )
    return t
