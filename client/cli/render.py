"""Rich renderings of plans and plan records for the terminal."""

from __future__ import annotations

from rich.table import Table

from client.contract import Placement, Plan, PlanRecord
from client.units import format_bytes


def plan_table(plan: Plan, title: str = "plan") -> Table:
    t = Table(title=title, show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    s = plan.solver
    bound = f"{s.best_bound:.4f} s" if s.best_bound is not None else "-"
    gap = f"{s.gap:.2%}" if s.gap is not None else "-"
    t.add_row("solver", f"{s.solver} {s.solver_version}: {s.status.value} in {s.solve_s:.2f} s (bound {bound}, gap {gap})")
    if s.message:
        t.add_row("", s.message)
    c = plan.constraints
    host = format_bytes(c.host_memory_bytes) if c.host_memory_bytes else "trace's host memory"
    t.add_row("limits", f"device {format_bytes(c.device_memory_bytes)}, host {host}")
    if s.min_device_memory_bytes is not None:
        t.add_row("fits from", format_bytes(s.min_device_memory_bytes))
    if plan.policy is not None:
        p = plan.policy
        persistent = sum(1 for ch in p.chunks if ch.placement == Placement.persistent)
        strip = "".join("P" if ch.placement == Placement.persistent else "o" for ch in p.chunks)
        t.add_row("chunks", f"{len(p.chunks)} x {format_bytes(p.chunk_size_bytes)}: {persistent} persistent, "
                            f"{len(p.chunks) - persistent} offloaded, {p.n_buffers} buffers")
        t.add_row("chunk strip", f"{strip}  (P persistent, o offloaded)")
        t.add_row("block modes", f"{p.mode_strip()}  (K keep, C checkpoint, S swap)")
    if plan.predictions is not None:
        pr = plan.predictions
        t.add_row("predicted", f"{pr.iteration_s * 1e3:.1f} ms/iter (fwd {pr.forward_s * 1e3:.1f}, bwd "
                               f"{pr.backward_s * 1e3:.1f}, optim dev {pr.device_optimizer_s * 1e3:.1f} / host "
                               f"{pr.host_optimizer_s * 1e3:.1f})")
        t.add_row("peak memory", f"device {format_bytes(pr.peak_device_bytes)}, host {format_bytes(pr.peak_host_bytes)}")
    if plan.allocation is not None:
        a = plan.allocation
        t.add_row("allocation", f"arena {format_bytes(a.arena_bytes)} vs lower bound {format_bytes(a.lower_bound_bytes)}"
                                f" (gap {a.gap:.2%}, {a.status.value}, {len(a.offsets)} buffers)")
    return t


def plans_table(records: list[PlanRecord]) -> Table:
    t = Table(title="plans")
    for col in ("id", "status", "model", "hardware", "device limit", "predicted", "created"):
        t.add_column(col)
    for r in records:
        pred = r.headline.predictions if r.headline else None
        t.add_row(r.id[:12], r.status, r.model_name, r.hardware_key, format_bytes(r.constraints.device_memory_bytes),
                  f"{pred.iteration_s * 1e3:.1f} ms" if pred else "-", r.created_at.strftime("%Y-%m-%d %H:%M:%S"))
    return t
