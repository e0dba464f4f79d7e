"""Feedback: what the runtime measured while applying a plan, to check the plan's predictions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from client.contract.common import SCHEMA_VERSION, Bytes, ContractModel, Float, Int, Seconds, Text

if TYPE_CHECKING:
    from client.contract.plan import Predictions


class MeasuredPhases(ContractModel):
    """Where the measured iteration went, phase by phase (medians over the timed steps; a multi-rank job's
    figures are the slowest rank's, phase by phase). The three phases add up to the iteration."""

    forward_s: Seconds = Field(
        description="the model's forward calls of one step (every micro-batch's, the loss where the model "
        "computes it)"
    )
    backward_s: Seconds = Field(
        description="the rest of the iteration: from the last forward's end to optimizer.step(), and after "
        "it to the next forward (loss.backward() with the host work that runs in it, gradient reductions, "
        "the user's clipping, zero_grad, data loading)"
    )
    step_s: Seconds = Field(description="optimizer.step() (device steps, redone host steps, checks)")
    uploads_per_iteration: Float | None = Field(
        default=None,
        ge=0.0,
        le=1e9,
        description="offloaded chunks uploaded to the device per iteration, evaluation forwards under no_grad "
        "left out (None: no chunk runtime)",
    )

    def errors(self, predicted: Predictions) -> dict[str, float]:
        """measured / predicted - 1 of each phase (`Predictions.phases`) and of the uploads per iteration; a
        quantity predicted 0 or not predicted is left out."""
        pairs: list[tuple[str, float, float | None]] = [
            (k, getattr(self, k), p) for k, p in predicted.phases().items()
        ]
        if self.uploads_per_iteration is not None:
            pairs.append(
                ("uploads_per_iteration", self.uploads_per_iteration, predicted.uploads_per_iteration)
            )
        return {k: m / p - 1.0 for k, m, p in pairs if p is not None and p > 0}


class Feedback(ContractModel):
    schema_version: Literal[1] = SCHEMA_VERSION
    iteration_s: Seconds = Field(description="measured median iteration seconds")
    peak_device_bytes: Bytes
    peak_host_bytes: Bytes
    steps_measured: Int = Field(ge=1, le=10_000_000)
    notes: Text = Field(default="", max_length=4096)
    phases: MeasuredPhases | None = Field(
        default=None, description="the iteration by phase (absent from agents before phases were measured)"
    )
