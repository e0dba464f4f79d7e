"""Shared building blocks of the wire contract: the strict base model, unit-carrying types, limits."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, Strict

SCHEMA_VERSION: Final = 1  # plans and feedback
# Traces: 2 sends the allocation events as packed arrays (`EventArrays`); 1 sent them as JSON lists and is
# still accepted (read as 2).
TRACE_SCHEMA_VERSION: Final = 2

# Declared limits. Anything larger is rejected by validation (and, in the service, before parsing).
MAX_BLOCKS: Final = 4_096
MAX_PARAMETERS: Final = 200_000
MAX_BANDWIDTH_SAMPLES: Final = 64
MAX_ALLOCATION_EVENTS: Final = 2_000_000
MAX_NAME_CHARS: Final = 512
MAX_MODEL_CONFIG_KEYS: Final = 512  # a Hugging Face config's keys (a trace's `ModelInfo.config`, a what-if's)
MAX_CALIBRATION_MODELS: Final = 64

# Integers are strict: JSON `true` or `1.5` is not a size or an index.
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict()]  # ints are still accepted; bools and strings are not

# Units live in field names (`_bytes`, `_s`, `_bytes_per_s`); these aliases carry the range checks.
Bytes = Annotated[
    int, Strict(), Field(ge=0, le=2**53, description="a size in bytes (at most 2**53: exact in JSON doubles)")
]
PositiveBytes = Annotated[int, Strict(), Field(gt=0, le=2**53, description="a non-zero size in bytes")]
Seconds = Annotated[float, Strict(), Field(ge=0.0, le=1e9, description="a duration in seconds")]
BytesPerSecond = Annotated[
    float, Strict(), Field(gt=0.0, le=1e15, description="a throughput in bytes per second")
]
Count = Annotated[int, Strict(), Field(ge=0, le=2**53)]
# Strings: no NUL (U+0000) anywhere. PostgreSQL's text types refuse it (a 500 there where SQLite stores it);
# the contract refuses it on every backend, with a 422 naming the field. (Lone surrogates, the other thing a
# UTF-8 database cannot hold, never get this far: the JSON parser refuses them.) The pattern runs in
# pydantic-core's Rust regex engine: ~0.07 us a name (200k parameter names: 17-21 ms -> 31-34 ms to validate).
NO_NUL_PATTERN: Final = r"^[^\x00]*$"
NO_NUL_MESSAGE: Final = "must not contain NUL (\\u0000) characters"
Text = Annotated[str, Field(pattern=NO_NUL_PATTERN)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=NO_NUL_PATTERN)]


def has_nul(value: str) -> bool:
    """True if `value` holds a character the contract's strings refuse (see `NO_NUL_PATTERN`)."""
    return "\x00" in value


class ContractModel(BaseModel):
    """Base of every wire model: unknown fields, NaN and infinity are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=False)

    def canonical_json(self) -> bytes:
        """Deterministic compact JSON: fields in definition order (part of the contract), no whitespace.

        The input of content hashes. Uses pydantic's Rust serialiser: a 60k-event trace in ~20 ms.
        """
        return self.model_dump_json().encode()

    def content_hash(self) -> str:
        """SHA-256 of the canonical JSON, hex: equal content gives an equal hash, on every machine."""
        return hashlib.sha256(self.canonical_json()).hexdigest()


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
