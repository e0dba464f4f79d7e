"""Feedback: measure the managed job for N steps and send what was measured to the service (or keep it locally).

`StepMonitor` hooks the wrapped model and optimizer (a forward pre-hook on the model, a step post-hook
on the optimizer; both removed by `close()`):
- iteration time: wall seconds between consecutive `optimizer.step()` returns (on CUDA after a
  synchronize, so queued kernels are counted), skipping the first `warmup` steps and the metered step;
- the same steps by phase (`MeasuredPhases`): the model's forward calls with gradients on (a forward post-hook
  on the model; every micro-batch's), `optimizer.step()` (a step pre-hook), the rest of the iteration, and the
  chunk runtime's uploads per iteration (its counters). Timed with the profiler's `DeviceClock`: wall time on
  CPU; on CUDA timing events on the compute stream, read after the synchronize that ends each step, so the
  phases add no synchronisation (events written for CUDA, run here under the stream-ordering checker only);
- gradient accumulation: a step whose forwards with gradients hold clearly more than one planned batch
  (their rows x sequence summed, at least `ACCUMULATION_BATCHES` of the batch the plan was made for) ran
  several iterations of the plan; its iteration, phases and uploads are the last pass's (from its forward's
  start to the step's end: the plan's iteration, the final micro-step's gradient work and optimizer step
  included), and the feedback's notes say how many passes the steps ran. Micro-batches that together make
  one planned batch are one iteration (the step, as without accumulation). Before (session 32), four
  full-batch passes per step were measured as one iteration: ~4x the prediction, 4x its uploads;
- peak device bytes: one iteration (the step after warm-up) runs under `DevicePeakMeter` (profiler
  semantics, see `measure.py`);
- peak host bytes: the runtime's host memory (offloaded chunks' states) plus the swap store's peak of
  host buffers in that same iteration.
After `steps` steps it builds a `Feedback` and hands it to a `FeedbackSink`: `ServiceSink` posts it to
the plan on the service; `LocalSink` appends it as one JSON line to a file (the embedded default, or when
the service cannot be reached). A post to the service runs on a background thread, so a slow service
never stalls the step; a sink that fails never raises into the training loop: it logs once and the
feedback is written locally instead.

A `StepRecorder` (`agent.allocator.managed_step.ManagedStepRecorder`, given by `wrap`) is told when the
metered step starts and ends, and receives the meter's storage tracker of it (CPU): the metered step is the
plan's managed iteration, recorded once for the plan's allocation. It is told to send it when the feedback
is sent, after the timed steps, so its work in the background is in none of them.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from agent.batch_guard import batch_shape
from agent.measure import DevicePeakMeter, device_state_tensors
from agent.profiler.device_clock import DeviceClock, Mark
from agent.runtime.eager import eager
from client.contract import Feedback, MeasuredPhases
from client.errors import UnprocessableEntityError
from client.sdk import Client

if TYPE_CHECKING:
    from agent.profiler.storage_tracker import StorageTracker
    from agent.runtime.activations import ActivationManager
    from agent.runtime.manager import ModelStateManager
    from agent.runtime.process_group import RankGroup

log = logging.getLogger(__name__)

DEFAULT_LOCAL_FEEDBACK = Path.home() / ".memplan" / "feedback.jsonl"
SEND_WAIT_S = 15.0
"""The most a monitor waits, over all its calls, for its background posts (the job's end pays it once)."""


_ANNOUNCED: set[Path] = set()  # local feedback files this process has told the user about


def local_feedback_path() -> Path:
    """Where feedback is recorded locally: MEMPLAN_FEEDBACK_PATH, else ~/.memplan/feedback.jsonl."""
    env = os.environ.get("MEMPLAN_FEEDBACK_PATH")
    return Path(env) if env else DEFAULT_LOCAL_FEEDBACK


class StepRecorder(Protocol):
    """Records the metered step (see the module doc); none of its calls raises into the training loop."""

    def start(self) -> None:
        """The metered step's first forward is about to run (its meter is on)."""
        ...

    def finish(self, window: StorageTracker | None) -> None:
        """The metered step's optimizer step returned; `window`: the meter's tracker of it (CPU), else None."""
        ...

    def publish(self) -> None:
        """The feedback was sent (the timed steps are over): send what was recorded."""
        ...

    def abort(self) -> None:
        """The monitor closed during the metered step."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Wait for work the recorder runs in the background."""
        ...

    @property
    def running(self) -> bool:
        """Its background work is in flight."""
        ...


class FeedbackSink(Protocol):
    def send(self, feedback: Feedback) -> str:
        """Deliver the feedback; return where it went (for the report)."""
        ...


@dataclass
class LocalSink:
    """Appends `{"plan_id", "trace_hash", "feedback"}` as one JSON line to `path`."""

    path: Path = field(default_factory=local_feedback_path)
    plan_id: str | None = None
    trace_hash: str | None = None

    def __post_init__(self) -> None:
        self.path = Path(self.path).expanduser()  # a str or `~/...` from the user's `wrap(feedback_path=...)`

    def send(self, feedback: Feedback) -> str:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(
            {
                "plan_id": self.plan_id,
                "trace_hash": self.trace_hash,
                "feedback": feedback.model_dump(mode="json"),
            },
            sort_keys=True,
        )
        with self.path.open("a") as f:
            f.write(line + "\n")
        if self.path not in _ANNOUNCED:  # said once per file and process, not at every run's feedback
            _ANNOUNCED.add(self.path)
            log.warning(
                "memplan: feedback (what was measured against the plan's predictions) is recorded in %s, "
                "not in a planner service: pass server= or set MEMPLAN_SERVER to keep it beside the plan; "
                "MEMPLAN_FEEDBACK_PATH moves the file",
                self.path,
            )
        return f"recorded locally in {self.path}"


@dataclass
class ServiceSink:
    """Posts the feedback to `/v1/plans/{plan_id}/feedback`; on any failure records it locally instead."""

    server: str
    plan_id: str
    fallback: LocalSink = field(default_factory=LocalSink)
    timeout_s: float = 5.0

    def send(self, feedback: Feedback) -> str:

        try:
            with Client(self.server, timeout=self.timeout_s, max_retries=1) as c:
                try:
                    rec = c.post_feedback(self.plan_id, feedback)
                except UnprocessableEntityError as exc:
                    if feedback.phases is None or not _refuses_field(exc, "phases"):
                        raise
                    # a service from before the phases (it refuses unknown fields): the rest still checks the plan
                    rec = c.post_feedback(self.plan_id, feedback.model_copy(update={"phases": None}))
                    log.warning(
                        "memplan: service %s predates feedback phases (upgrade it to check them); posted the "
                        "iteration and peaks only",
                        self.server,
                    )
            return f"posted to {self.server} (plan {self.plan_id[:12]}, feedback {rec.id[:12]})"
        except Exception as exc:  # noqa: BLE001 - the training job comes first
            log.warning(
                "memplan: could not post feedback to %s (%s: %s); recording it locally",
                self.server,
                type(exc).__name__,
                exc,
            )
            self.fallback.plan_id = self.fallback.plan_id or self.plan_id
            return self.fallback.send(feedback)


def _refuses_field(exc: UnprocessableEntityError, name: str) -> bool:
    """The 422 names `body.<name>` (the service's error shape: detail items with `field`)."""
    detail = exc.detail if isinstance(exc.detail, list) else []
    return any(isinstance(d, dict) and d.get("field") == f"body.{name}" for d in detail)


@dataclass
class Measured:
    """What the monitor measured so far."""

    iteration_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)  # per timed step, as `iteration_s`
    passes: list[int] = field(default_factory=list)  # per timed step: its passes when accumulating, else 1
    step_s: list[float] = field(default_factory=list)
    uploads: int | None = None  # the chunk runtime's uploads over the timed steps (None: no chunk runtime)
    peak_device_bytes: int | None = None
    peak_host_bytes: int | None = None
    steps: int = 0
    sent: Feedback | None = None
    sent_to: str | None = None

    def feedback(self, notes: str = "") -> Feedback | None:
        if not self.iteration_s or self.peak_device_bytes is None or self.peak_host_bytes is None:
            return None
        passes = max(self.passes, default=1)
        if passes > 1:
            accumulation = (
                f"gradient accumulation: up to {passes} forward/backward passes of the planned batch per "
                "optimizer.step(); the iteration, phases and uploads are the last pass's (its forward to the "
                "step's end)"
            )
            notes = f"{notes}; {accumulation}" if notes else accumulation
        return Feedback(
            iteration_s=float(statistics.median(self.iteration_s)),
            peak_device_bytes=self.peak_device_bytes,
            peak_host_bytes=self.peak_host_bytes,
            steps_measured=len(self.iteration_s),
            notes=notes,
            phases=self.phases(),
        )

    def phases(self) -> MeasuredPhases | None:
        """The timed steps by phase: each phase's median, the rest of the iteration the median of each step's
        iteration less its forward and step (so the three add up to about the median iteration)."""
        n = len(self.iteration_s)
        if not n or len(self.forward_s) != n or len(self.step_s) != n:
            return None
        rest = [
            max(0.0, t - f - s) for t, f, s in zip(self.iteration_s, self.forward_s, self.step_s, strict=True)
        ]
        return MeasuredPhases(
            forward_s=float(statistics.median(self.forward_s)),
            backward_s=float(statistics.median(rest)),
            step_s=float(statistics.median(self.step_s)),
            uploads_per_iteration=None if self.uploads is None else self.uploads / n,
        )


WARMUP_STEPS = 2
"""Steps the monitor lets pass before it measures (the first steps record access orders, fill caches)."""
MIN_FEEDBACK_STEPS = WARMUP_STEPS + 2
"""The fewest `wrap(feedback_steps=...)` the monitor can measure in: warm-up, a metered step, a timed step."""
ACCUMULATION_BATCHES = 1.5
"""A step whose forwards with gradients hold at least this many planned batches (rows x sequence) accumulates
gradients over several iterations of the plan (see the module docstring); less is micro-batches of one."""


def check_feedback_steps(steps: int | None) -> None:
    """`wrap`'s argument check (before anything is profiled or wrapped): None or 0 (no monitor), else at least
    `MIN_FEEDBACK_STEPS`."""
    if steps and steps < MIN_FEEDBACK_STEPS:
        raise ValueError(
            f"feedback_steps: must be at least {MIN_FEEDBACK_STEPS} (warm-up, a metered step, a timed step), "
            f"got {steps}; None sends no feedback"
        )


class StepMonitor:
    """Measures iteration time and peaks of a wrapped job and sends feedback after `steps` steps."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        manager: ModelStateManager | None,
        activations: ActivationManager | None,
        sink: FeedbackSink | None,
        steps: int,  # `wrap(feedback_steps=...)`, default `agent.wrapping.DEFAULT_FEEDBACK_STEPS`
        warmup: int = WARMUP_STEPS,
        notes: Callable[[], str] | None = None,
        group: RankGroup | None = None,
        recorder: StepRecorder | None = None,
        planned_shape: tuple[int, int] | None = None,
    ) -> None:
        if steps < warmup + 2:
            raise ValueError(
                f"feedback_steps: must be at least {warmup + 2} (warm-up, a metered step, a timed step)"
            )
        self.model = model
        self.device = device
        self.manager = manager
        self.activations = activations
        self.sink = sink
        self.steps = steps
        self.warmup = warmup
        self.group = group  # the job's process group: feedback is the job's, sent by rank 0 (issue 20)
        self.recorder = recorder
        self.measured = Measured()
        self._notes = notes
        self._meter = DevicePeakMeter(device)
        self._metering = False
        self._last: float | None = None
        # events where the runtime takes its CUDA code paths (as the probes' clocks: the runtime's own answer)
        self._clock = DeviceClock(device, cuda=manager.ctx.is_cuda if manager is not None else None)
        self._forward_start: Mark | None = None
        self._forwards: list[tuple[Mark, Mark]] = []  # this step's forward calls (timed steps only)
        self._step_start: Mark | None = None
        # the planned batch's rows x sequence (None: unknown, every step is one iteration); this step's forwards
        # with gradients (passes) and their rows x sequence summed
        self._planned = planned_shape[0] * planned_shape[1] if planned_shape is not None else None
        self._passes = 0
        self._pass_rows = 0
        self._pass_wall = 0.0  # when the step's latest forward with gradients started (wall clock)
        self._pass_uploads = 0  # the runtime's upload count then
        self._uploads_at: int | None = None  # the runtime's upload count when the step's window opened
        self._eval_uploads_at: int | None = None  # ... when an evaluation forward (no grad) started
        self._eval_uploads = 0  # uploads of this step's evaluation forwards: not the training iteration's
        self._pass_eval_uploads = 0  # ... of those after its latest forward with gradients started
        self._sender: threading.Thread | None = None
        self._wait_left_s = SEND_WAIT_S  # `wait_sent`'s budget over every call
        self._said_behind = False
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(eager(self._before_forward), with_kwargs=True),
            model.register_forward_hook(eager(self._after_forward)),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    @property
    def meter_step(self) -> int:
        """The step (0-based) that runs under the device-memory meter: the first after warm-up."""
        return self.warmup

    def _timing(self) -> bool:
        """This step is a timed one (after warm-up and the metered step: its iteration is measured)."""
        return self.measured.steps > self.meter_step and self._last is not None

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.measured.sent is not None:
            # measuring is over: the hooks go (from here, not from the optimizer's post-step hook, whose
            # registry torch iterates live), so no step pays for them again (issue 19, defect 9: the CUDA
            # synchronize in `_after_step` ran after every step for the whole run)
            self._remove_hooks()
            return
        if self._timing() and torch.is_grad_enabled():  # an evaluation forward (no grad) is not the step's
            self._forward_start = self._clock.mark()
            shape = batch_shape(kwargs) if kwargs else batch_shape(args)
            self._passes += 1
            self._pass_rows += shape[0] * shape[1] if shape is not None else 0
            self._pass_wall = time.perf_counter()
            if self.manager is not None:
                self._pass_uploads = self.manager.counters.uploads
                self._pass_eval_uploads = 0  # an evaluation before this pass is outside its window
        elif self._timing() and self.manager is not None:
            self._eval_uploads_at = self.manager.counters.uploads
        if self._metering or self.measured.steps != self.meter_step or not torch.is_grad_enabled():
            return
        self._metering = True
        if self.activations is not None and self.activations.store is not None:
            c = self.activations.store.counters
            c.host_bytes_peak = c.host_bytes_live
        self._meter.start(device_state_tensors(self.model, self.manager), (args, kwargs))
        if self.recorder is not None:
            self.recorder.start()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._forward_start is not None:
            self._forwards.append((self._forward_start, self._clock.mark()))
            self._forward_start = None
        if self._eval_uploads_at is not None and self.manager is not None:
            uploads = self.manager.counters.uploads - self._eval_uploads_at
            self._eval_uploads += uploads
            self._pass_eval_uploads += uploads
            self._eval_uploads_at = None

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.measured.sent is None and self._timing():
            self._step_start = self._clock.mark()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.measured.sent is not None:
            return  # measured and sent: no synchronize, nothing to count (the hooks go at the next forward)
        end = self._clock.mark() if self._step_start is not None else None
        self._clock.synchronize()  # on CUDA: queued kernels are counted, and the step's events can be read
        now = time.perf_counter()
        if self._metering:
            self._metering = False
            self.measured.peak_device_bytes = self._meter.stop()
            self.measured.peak_host_bytes = self._host_bytes()
            if self.recorder is not None:
                self.recorder.finish(self._meter.window)
        elif self._timing():
            assert self._last is not None
            passes = self._accumulated_passes()
            self.measured.passes.append(passes)
            self.measured.iteration_s.append(now - (self._pass_wall if passes > 1 else self._last))
            self._record_phases(end, last_pass=passes > 1)
        self._forwards, self._forward_start, self._step_start = [], None, None
        self._passes = self._pass_rows = 0
        self._eval_uploads_at, self._eval_uploads, self._pass_eval_uploads = None, 0, 0
        self.measured.steps += 1
        self._last = time.perf_counter()
        self._uploads_at = self.manager.counters.uploads if self.manager is not None else None
        if self.measured.steps == self.steps and self.measured.sent is None:
            self.flush()

    def _accumulated_passes(self) -> int:
        """This step's forwards with gradients when they hold at least `ACCUMULATION_BATCHES` planned batches
        (gradient accumulation over several iterations of the plan), else 1 (one iteration)."""
        if self._passes < 2 or not self._planned:
            return 1
        return self._passes if self._pass_rows >= ACCUMULATION_BATCHES * self._planned else 1

    def _record_phases(self, end: Mark | None, *, last_pass: bool) -> None:
        """A timed step's forward and step seconds, and its uploads (the clock synchronised after `end`); the
        last pass's only (`last_pass`: gradient accumulation, see the module docstring)."""
        m = self.measured
        forwards = self._forwards[-1:] if last_pass else self._forwards
        m.forward_s.append(sum(self._clock.seconds(a, b) for a, b in forwards))
        m.step_s.append(self._clock.seconds(self._step_start, end) if self._step_start and end else 0.0)
        if self.manager is not None and self._uploads_at is not None:
            start, evals = (
                (self._pass_uploads, self._pass_eval_uploads)
                if last_pass
                else (self._uploads_at, self._eval_uploads)
            )
            m.uploads = (m.uploads or 0) + self.manager.counters.uploads - start - evals

    def _host_bytes(self) -> int:
        host = 0
        if self.manager is not None:
            host += self.manager.memory_report().host_bytes
        if self.activations is not None and self.activations.store is not None:
            host += self.activations.store.counters.host_bytes_peak
        return host

    def flush(self) -> Feedback | None:
        """Send what was measured now (also called automatically after `steps` steps)."""
        fb = self.measured.feedback(self._notes() if self._notes else "")
        if fb is None or self.measured.sent is not None:
            return self.measured.sent
        if self.group is not None:
            # the job's figures: the slowest rank's time, the largest rank's peaks (a collective: every
            # rank flushes after the same number of steps)
            ph = fb.phases
            slowest = self.group.max(
                [fb.iteration_s, fb.peak_device_bytes, fb.peak_host_bytes]
                + (
                    [ph.forward_s, ph.backward_s, ph.step_s, ph.uploads_per_iteration or 0.0]
                    if ph
                    else [0.0] * 4
                )
            )
            t, dev, host, fwd, bwd, stp, uploads = slowest
            phases = None
            if ph is not None:  # every rank has phases or none does (the same code measured the same steps)
                phases = MeasuredPhases(
                    forward_s=fwd,
                    backward_s=bwd,
                    step_s=stp,
                    uploads_per_iteration=None if ph.uploads_per_iteration is None else uploads,
                )
            fb = fb.model_copy(
                update={
                    "iteration_s": t,
                    "peak_device_bytes": int(dev),
                    "peak_host_bytes": int(host),
                    "phases": phases,
                }
            )
            if not self.group.is_main:
                self.measured.sent = fb
                self.measured.sent_to = (
                    f"not sent by rank {self.group.rank} (rank 0 sends the job's feedback)"
                )
                return fb
        self.measured.sent = fb
        if self.recorder is not None:
            self.recorder.publish()
        if self.sink is None:
            return fb
        if isinstance(self.sink, ServiceSink):
            # a slow service must not stall the training step: post from a background thread
            self.measured.sent_to = "posting"
            self._sender = threading.Thread(
                target=self._send, args=(fb,), name="memplan-feedback", daemon=True
            )
            self._sender.start()
        else:
            self._send(fb)
        return fb

    def _send(self, fb: Feedback) -> None:
        assert self.sink is not None
        try:
            self.measured.sent_to = self.sink.send(fb)
        except Exception as exc:  # noqa: BLE001 - never let feedback break the training loop
            log.warning("memplan: feedback could not be recorded (%s: %s)", type(exc).__name__, exc)
            self.measured.sent_to = f"not recorded ({type(exc).__name__})"
        log.info("memplan: feedback after %d steps %s", self.measured.steps, self.measured.sent_to)

    def wait_sent(self, timeout_s: float | None = None) -> None:
        """Wait for the feedback post and the managed allocation's placement in flight (before reading the
        report, and at `close`): at most `timeout_s` when given, else what is left of `SEND_WAIT_S` over every
        such call of this monitor, so a service that hangs costs the job's end that once (it cost 15 s per
        thread per call: 40 s for `report()` then `unwrap` against a hanging service)."""
        budget = self._wait_left_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        if self._sender is not None:
            self._sender.join(budget)
        if self.recorder is not None:
            self.recorder.wait(max(0.0, budget - (time.monotonic() - t0)))
        self._wait_left_s = max(0.0, self._wait_left_s - (time.monotonic() - t0))
        behind = [
            what
            for what, running in (
                ("the feedback", self._sender is not None and self._sender.is_alive()),
                ("the managed allocation", self.recorder is not None and self.recorder.running),
            )
            if running
        ]
        if behind and not self._wait_left_s and not self._said_behind:
            self._said_behind = True
            log.warning(
                "memplan: %s still in flight after %.0fs; not waiting for it any longer (it goes on in the "
                "background while this process lives: a slow or silent service, or a long placement)",
                " and ".join(behind),
                SEND_WAIT_S,
            )

    def close(self) -> None:
        self.wait_sent()
        if self._metering:
            self._metering = False
            self._meter.stop()
            if self.recorder is not None:
                self.recorder.abort()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
