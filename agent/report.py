"""What `agent.wrap(...).report()` says: plan summary, predicted vs measured, feedback, and what the runtime did."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.runtime.accounting import Counters, MemoryReport, RuntimeReport
    from agent.runtime.swap import SwapCounters
    from client.contract import Feedback


Row = tuple[str, str, str, str]  # quantity, predicted, measured, error
PHASE_LABELS = {"forward_s": "forward", "backward_s": "backward, rest", "step_s": "optimizer.step()"}


def _count(n: int, word: str) -> str:
    """`1 chunk`, `2 chunks`."""
    return f"{n} {word}{'' if n == 1 else 's'}"


@dataclass
class WrapReport:
    """Plan summary, predicted vs measured, and what the runtime did."""

    origin: str
    message: str
    solver: str
    solver_status: str
    mode_strip: str
    chunks: int
    offloaded_chunks: int
    n_buffers: int
    predicted_iteration_s: float | None
    predicted_peak_device_bytes: int | None
    predicted_peak_host_bytes: int | None
    measured: Feedback | None
    feedback_to: str | None
    runtime: RuntimeReport
    swap: SwapCounters | None = None
    notes: list[str] = field(default_factory=list)
    predicted_phases: dict[str, float] | None = None  # `Predictions.phases`
    predicted_uploads: float | None = None  # chunk uploads per iteration

    # the model-state runtime's figures, as `RuntimeReport` names them
    @property
    def memory(self) -> MemoryReport:
        return self.runtime.memory

    @property
    def counters(self) -> Counters:
        return self.runtime.counters

    @staticmethod
    def _err(measured: float | None, predicted: float | None) -> str:
        if measured is None or not predicted:
            return "-"
        return f"{(measured / predicted - 1.0) * 100:+.1f}%"

    def rows(self) -> list[Row]:
        """(quantity, predicted, measured, error) rows for a table."""
        mib = 2**20

        def b(x: float | None) -> str:
            return "-" if x is None else f"{x / mib:.2f} MiB"

        def s(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.1f} ms"

        return [
            *self._main_rows(b, s),
            *self._phase_rows(s),
        ]

    def _main_rows(self, b: Callable[[float | None], str], s: Callable[[float | None], str]) -> list[Row]:
        m = self.measured
        return [
            (
                "iteration time",
                s(self.predicted_iteration_s),
                s(m.iteration_s if m else None),
                self._err(m.iteration_s if m else None, self.predicted_iteration_s),
            ),
            (
                "peak device memory",
                b(self.predicted_peak_device_bytes),
                b(m.peak_device_bytes if m else None),
                self._err(m.peak_device_bytes if m else None, self.predicted_peak_device_bytes),
            ),
            (
                "peak host memory",
                b(self.predicted_peak_host_bytes),
                b(m.peak_host_bytes if m else None),
                self._err(m.peak_host_bytes if m else None, self.predicted_peak_host_bytes),
            ),
        ]

    def _phase_rows(self, s: Callable[[float | None], str]) -> list[Row]:
        """The iteration by phase, and the chunk uploads (once the monitor measured them)."""
        ph = self.measured.phases if self.measured else None
        if ph is None or self.predicted_phases is None:
            return []
        rows: list[Row] = [
            (
                f"  {label}",
                s(self.predicted_phases[k]),
                s(getattr(ph, k)),
                self._err(getattr(ph, k), self.predicted_phases[k]),
            )
            for k, label in PHASE_LABELS.items()
        ]
        if ph.uploads_per_iteration is not None and self.predicted_uploads is not None:
            rows.append(
                (
                    "chunk uploads/iter",
                    f"{self.predicted_uploads:g}",
                    f"{ph.uploads_per_iteration:g}",
                    self._err(ph.uploads_per_iteration, self.predicted_uploads),
                )
            )
        return rows

    def __str__(self) -> str:
        lines = [
            f"plan: {self.message}{'' if self.origin in self.message else f' [{self.origin}]'}; solver {self.solver} ({self.solver_status}); modes {self.mode_strip}; "
            f"{_count(self.chunks, 'chunk')}, {self.offloaded_chunks} offloaded, "
            f"{_count(self.n_buffers, 'device buffer')} for offloaded chunks",
        ]
        for q, p, mm, e in self.rows():
            lines.append(f"  {q:<20} predicted {p:>12}  measured {mm:>12}  {e:>8}")
        if self.feedback_to:
            lines.append(f"  feedback: {self.feedback_to}")
        if self.swap is not None:
            lines.append(
                f"  swap: {self.swap.swapped_out_bytes / 2**20:.1f} MiB out, {self.swap.prefetched_blocks} blocks "
                f"prefetched, {self.swap.late_fetches} late, {self.swap.demand_fetches} on demand"
            )
        lines.append(f"  runtime: {self.runtime}")
        return "\n".join(lines)
