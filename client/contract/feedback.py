"""Feedback: what the runtime measured while applying a plan, to check the plan's predictions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from client.contract.common import SCHEMA_VERSION, Bytes, ContractModel, Int, Seconds, Text


class Feedback(ContractModel):
    schema_version: Literal[1] = SCHEMA_VERSION
    iteration_s: Seconds = Field(description="measured median iteration seconds")
    peak_device_bytes: Bytes
    peak_host_bytes: Bytes
    steps_measured: Int = Field(ge=1, le=10_000_000)
    notes: Text = Field(default="", max_length=4096)
