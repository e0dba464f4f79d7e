"""Hardware catalogue entries: what a what-if plan needs to know about an accelerator it has never run on.

One entry per accelerator (and its usual host): device memory, memory bandwidth, dense throughput per
precision, the host link with its sustained copy rates, and a typical host. The service ships a catalogue
(`planner_service/whatif/catalog.json`, every figure sourced in docs/architecture/hardware.md); users add
entries from a file of the same shape. A modelled trace names its entry (`ModelledFrom.hardware_key`).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from client.contract.common import BytesPerSecond, ContractModel, Int, Name, PositiveBytes

FlopsPerSecond = Annotated[float, Field(gt=0.0, le=1e18, description="floating-point operations per second")]
MAX_CATALOG_ENTRIES = 1_000
_KEY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


class LinkKind(StrEnum):
    pcie = "pcie"
    nvlink_c2c = "nvlink-c2c"


class HostLink(ContractModel):
    """The device's link to host memory. Rates are per direction; `sustained` are what copies achieve."""

    kind: LinkKind
    pcie_generation: Int | None = Field(default=None, ge=1, le=7, description="PCIe only")
    lanes: Int | None = Field(default=None, ge=1, le=32, description="PCIe only")
    peak_bytes_per_s: BytesPerSecond = Field(description="theoretical rate of the link, one direction")
    h2d_bytes_per_s: BytesPerSecond = Field(description="sustained pinned host-to-device copy rate")
    d2h_bytes_per_s: BytesPerSecond = Field(description="sustained pinned device-to-host copy rate")
    # both directions at once (a measured host may lose some to its memory system or root complex); absent:
    # each direction keeps its own sustained rate (PCIe and NVLink-C2C are full duplex)
    duplex_h2d_bytes_per_s: BytesPerSecond | None = Field(
        default=None, description="sustained pinned H2D rate while a D2H copy runs; default h2d_bytes_per_s"
    )
    duplex_d2h_bytes_per_s: BytesPerSecond | None = Field(
        default=None, description="sustained pinned D2H rate while an H2D copy runs; default d2h_bytes_per_s"
    )

    @model_validator(mode="after")
    def _consistent(self) -> HostLink:
        if self.kind == LinkKind.pcie and (self.pcie_generation is None or self.lanes is None):
            raise ValueError("pcie_generation, lanes: required for a PCIe link")
        for name in (
            "h2d_bytes_per_s",
            "d2h_bytes_per_s",
            "duplex_h2d_bytes_per_s",
            "duplex_d2h_bytes_per_s",
        ):
            if getattr(self, name) is not None and getattr(self, name) > self.peak_bytes_per_s:
                raise ValueError(
                    f"{name}: {getattr(self, name):.4g} exceeds the link's peak {self.peak_bytes_per_s:.4g}"
                )
        return self


class PeerLink(ContractModel):
    """The device's link to the other devices of its node, when it is not PCIe through the host (NVLink
    through NVSwitch on HGX boards): rates per direction per device. Absent: peers talk over the host link
    (issue 20; see docs/architecture/hardware.md, "Peer links")."""

    kind: Literal["nvlink"]
    generation: Int = Field(ge=1, le=10)
    peak_bytes_per_s: BytesPerSecond = Field(description="theoretical rate to the peers, one direction")
    sustained_bytes_per_s: BytesPerSecond = Field(description="what ring collectives achieve, one direction")

    @model_validator(mode="after")
    def _sustained_below_peak(self) -> PeerLink:
        if self.sustained_bytes_per_s > self.peak_bytes_per_s:
            raise ValueError(
                f"sustained_bytes_per_s: {self.sustained_bytes_per_s:.4g} exceeds the peak {self.peak_bytes_per_s:.4g}"
            )
        return self


class DenseThroughput(ContractModel):
    """Dense (no structured sparsity) peak throughput per training precision. fp32 is the non-tensor-core
    rate (PyTorch's default: TF32 matmuls are off); bf16/fp16 are tensor-core rates with fp32 accumulate."""

    bf16: FlopsPerSecond
    fp16: FlopsPerSecond
    fp32: FlopsPerSecond


class CatalogEntry(ContractModel):
    """One accelerator and its typical host (the host figures are overridable per question)."""

    key: Name = Field(description="stable lower-case id used on the command line, e.g. 'h100-sxm'")
    name: Name = Field(description="device name as the driver reports it, e.g. 'NVIDIA H100 80GB HBM3'")
    vendor: Name
    device_memory_bytes: PositiveBytes
    memory_bandwidth_bytes_per_s: BytesPerSecond = Field(description="peak device (HBM/GDDR) bandwidth")
    dense_flops: DenseThroughput
    host_link: HostLink
    host_memory_bytes: PositiveBytes = Field(description="typical host RAM available to one such device")
    cpu_cores: Int = Field(ge=1, le=100_000, description="typical host CPU cores available to one device")
    notes: str = Field(default="", max_length=1024, description="where the figures come from, in brief")
    # Left out of the JSON when absent: entries without one are unchanged (issue 20).
    peer_link: PeerLink | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="link to the node's other devices (NVLink); absent: over the host link",
    )

    @field_validator("key")
    @classmethod
    def _key_shape(cls, v: str) -> str:
        if not _KEY.match(v):
            raise ValueError(
                f"{v!r}: use lower-case letters, digits, '.', '_' or '-' (at most 64 characters)"
            )
        return v


class HardwareCatalog(ContractModel):
    """A list of entries with unique keys (the shipped catalogue, or a user's additions)."""

    entries: list[CatalogEntry] = Field(min_length=1, max_length=MAX_CATALOG_ENTRIES)

    @model_validator(mode="after")
    def _unique_keys(self) -> HardwareCatalog:
        seen: set[str] = set()
        for i, e in enumerate(self.entries):
            if e.key in seen:
                raise ValueError(f"entries[{i}].key: {e.key!r} appears twice")
            seen.add(e.key)
        return self
