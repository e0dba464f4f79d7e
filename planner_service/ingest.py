"""Trace ingestion: validate, hash and compress an uploaded body, in a process pool for large ones.

A 1 MB gzip trace costs ~0.2 s of CPU to validate and hash while holding the GIL; done in the API
process it would stall every other request on that event loop. Bodies above `inline_max_bytes` go to a
small pool of worker processes, and the API keeps only the few facts it stores (`TraceFacts`).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from client.contract import TRACE_SCHEMA_VERSION, Trace
from planner_service.lifeline import forkserver_context, pool_child_start


@dataclass(frozen=True)
class TraceFacts:
    """What the service stores about a trace besides its payload."""

    content_hash: str
    schema_version: int
    model_fingerprint: str
    model_name: str
    architecture: str
    parameter_count: int
    hardware_key: str
    device_type: str
    device_name: str
    device_memory_bytes: int
    device_count: int
    world_size: int
    ranks_per_node: int
    workload_key: str
    payload_gzip: bytes
    payload_bytes: int

    @classmethod
    def of(
        cls, trace: Trace, *, payload_gzip: bytes | None = None, payload_bytes: int | None = None
    ) -> TraceFacts:
        """Facts of a validated trace; `payload_gzip` (the client's gzip body, in the current schema) is
        stored as is, else the canonical JSON is compressed."""
        canonical = trace.canonical_json()
        if payload_gzip is None or payload_bytes is None:  # store the client's gzip as is when it sent one
            payload_gzip, payload_bytes = gzip.compress(canonical, compresslevel=1, mtime=0), len(canonical)
        m, h = trace.model, trace.hardware
        return cls(
            content_hash=hashlib.sha256(canonical).hexdigest(),
            schema_version=trace.schema_version,
            model_fingerprint=m.fingerprint,
            model_name=m.name,
            architecture=m.architecture,
            parameter_count=m.parameter_count,
            hardware_key=h.key,
            device_type=h.device_type.value,
            device_name=h.device_name,
            device_memory_bytes=h.machine_device_memory_bytes,
            device_count=h.device_count,
            world_size=h.world_size,
            ranks_per_node=h.ranks_per_node,
            workload_key=trace.workload.key,
            payload_gzip=payload_gzip,
            payload_bytes=payload_bytes,
        )


class BadGzip(ValueError):
    """Not gzip, or truncated (400)."""


class GzipTooLarge(ValueError):
    """Inflates beyond the limit (413)."""


INFLATE_STEP = 4 * 2**20  # inflate at most this much per call: memory stays near what is kept, not twice it


def gunzip_limited(data: bytes, limit: int) -> tuple[bytearray, int]:
    """Decompress gzip without ever holding much more than `limit` bytes (gzip-bomb safe), and the number of
    members it had. A gzip file may be several members back to back (RFC 1952): every member is inflated
    and all of them together count against `limit`; anything after a member that is not another whole
    member (garbage, a truncated member) is an error, so no byte of the body goes unchecked. Output grows in
    `INFLATE_STEP` pieces (one call with the whole limit held a second copy while assembling its result).
    Picklable errors: it also runs in the ingest processes."""
    out = bytearray()
    members = 0
    rest = data
    while True:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            piece = d.decompress(rest, INFLATE_STEP)
            while True:
                out += piece
                if len(out) > limit:
                    raise GzipTooLarge(
                        f"decompressed body larger than {limit} bytes (all gzip members together)"
                    )
                if d.eof:
                    break
                if not piece and not d.unconsumed_tail:
                    raise BadGzip(
                        "body is truncated gzip"
                        if members == 0
                        else f"gzip member {members + 1} is truncated"
                    )
                piece = d.decompress(d.unconsumed_tail, INFLATE_STEP)
        except zlib.error as exc:
            where = "body" if members == 0 else f"gzip member {members + 1} of the body"
            raise BadGzip(f"{where} is not valid gzip: {exc}") from None
        members += 1
        rest = d.unused_data
        if not rest:
            return out, members


class InvalidJson(ValueError):
    pass


class IngestUnavailable(RuntimeError):
    """An ingest process died under this upload on a fresh pool too (503: retry)."""


class InvalidTrace(ValueError):
    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("invalid trace")
        self.errors = errors


def inspect(data: bytes, gzipped: bool, max_decompressed_bytes: int) -> TraceFacts:
    """Inflate (bomb-safe), validate and derive the facts of an uploaded trace.

    Raises (all picklable) BadGzip, GzipTooLarge, InvalidJson, InvalidTrace.
    """
    raw: bytes | bytearray
    raw, members = gunzip_limited(data, max_decompressed_bytes) if gzipped else (data, 0)
    # What is stored is what was validated: the client's gzip as is only when it is one member that inflates
    # to exactly the bytes just validated; otherwise the canonical JSON, compressed here.
    gzip_body = data if members == 1 else None
    context: dict[str, Any] = {}
    try:
        trace = Trace.model_validate_json(raw, context=context)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise InvalidJson(f"body is not valid JSON: {errors[0]['msg']}") from None
        raise InvalidTrace(
            [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]
        ) from None
    if context.get("received_schema_version") != TRACE_SCHEMA_VERSION:
        gzip_body = None  # an older schema's upload is stored in the current form
    return TraceFacts.of(
        trace, payload_gzip=gzip_body, payload_bytes=len(raw) if gzip_body is not None else None
    )


@dataclass(frozen=True)
class Inspection:
    """An upload's facts and what deriving them took where it ran (the rest of the wait was the queue for an
    ingest process and the hand-over)."""

    facts: TraceFacts
    wall_s: float
    cpu_s: float


def _inspect_timed(data: bytes, gzipped: bool, max_decompressed_bytes: int) -> Inspection:
    wall, cpu = time.perf_counter(), time.thread_time()
    facts = inspect(data, gzipped, max_decompressed_bytes)
    return Inspection(facts, time.perf_counter() - wall, time.thread_time() - cpu)


def _start_ingest_process(niceness: int, owner_pid: int) -> None:
    """An ingest process dies with the API process that owns it (`lifeline`), and runs below request
    handling: validating a large upload is ~0.1 s of CPU, a poll ~1 ms, so let the poll go first."""
    pool_child_start(owner_pid)
    os.nice(niceness)


def _ready() -> int:
    """A no-op task whose pickled reference makes the pool process import this module (and the contract)."""
    return os.getpid()


class Ingestor:
    """Runs `inspect` inline for small bodies and in a process pool for large ones."""

    def __init__(self, processes: int, inline_max_bytes: int, niceness: int = 5) -> None:
        self.processes = processes
        self.inline_max_bytes = inline_max_bytes
        self.niceness = niceness
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # forkserver: never fork a process that runs threads (the API's thread pool, solve workers)
            # (and the forkserver and every pool process die with this process: `lifeline`)
            self._pool = ProcessPoolExecutor(
                self.processes,
                mp_context=forkserver_context(),
                initializer=_start_ingest_process,
                initargs=(self.niceness, os.getpid()),
            )
        return self._pool

    def prestart(self) -> None:
        """Start the pool's processes now (in the background) so the first large upload does not pay for
        the forkserver and the imports (~0.5-1 s of CPU)."""
        if self.processes:
            pool = self._executor()
            for _ in range(self.processes):
                pool.submit(_ready)

    async def inspect(self, data: bytes, gzipped: bool, max_decompressed_bytes: int) -> Inspection:
        """Small bodies in a thread of this process, large ones (size on the wire) in the pool.

        A pool whose process died (the OOM killer, an operator's kill, a crash in a C extension) is broken for
        good: every later large upload would be a 500 until the service restarts. It is replaced, and the upload
        tried once more on the new pool; a second death (the body itself kills the process, say) is
        `IngestUnavailable`, a 503."""
        loop = asyncio.get_running_loop()
        large = len(data) * (4 if gzipped else 1) > self.inline_max_bytes
        if not (self.processes and large):
            return await loop.run_in_executor(None, _inspect_timed, data, gzipped, max_decompressed_bytes)
        for _ in range(2):
            pool = self._executor()
            try:
                return await loop.run_in_executor(pool, _inspect_timed, data, gzipped, max_decompressed_bytes)
            except BrokenProcessPool:
                self._replace(pool)
        raise IngestUnavailable(
            "an ingest process died while validating this upload, on a fresh pool too: retry later"
        )

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """Drop a broken pool (once, whichever upload finds it broken first); the next upload starts a new one."""
        if self._pool is broken:
            self._pool = None
            broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            # Wait for the processes to exit (an upload in flight finishes): none outlives the API process.
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
