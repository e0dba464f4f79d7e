"""ctypes bindings of the planned allocator's C API (`csrc/planned_allocator.h`), one load per backend."""

from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, c_char_p, c_int, c_uint8, c_uint32, c_uint64, c_void_p
from pathlib import Path

from agent.allocator.build import Backend, library_path

STAT_FIELDS: tuple[str, ...] = (
    "arena_bytes",
    "reserved_bytes",
    "peak_reserved_bytes",
    "allocated_bytes",
    "peak_allocated_bytes",
    "requested_bytes",
    "peak_requested_bytes",
    "device_bytes",
    "peak_device_bytes",
    "allocs",
    "frees",
    "planned",
    "persistent",
    "shrunk",
    "resyncs",
    "skipped_slots",
    "mismatches",
    "displaced",
    "pool_fallbacks",
    "device_fallbacks",
    "before_cycle_allocs",
    "iterations",
    "live_blocks",
    "unknown_frees",
    "debug_violations",
    "failed_allocs",
    "unguarded_pool_fallbacks",
    "arena_reserve_failures",
)


class StatsStruct(ctypes.Structure):
    """Mirror of `mp_stats`: every field a uint64, in the header's order."""

    _fields_ = [(name, c_uint64) for name in STAT_FIELDS]


class Library:
    """The loaded shared library with typed entry points; `path` is what CUDAPluggableAllocator opens."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self.cdll = lib
        sig: dict[str, tuple[type | None, list[type]]] = {
            "mp_create": (
                c_void_p,
                [
                    c_uint64,
                    c_uint64,
                    POINTER(c_uint64),
                    POINTER(c_uint64),
                    POINTER(c_uint8),
                    c_uint64,
                    c_int,
                    c_uint32,
                    c_uint64,
                    c_uint64,
                    c_uint64,
                    c_int,
                ],
            ),
            "mp_destroy": (None, [c_void_p]),
            "mp_last_error": (c_char_p, []),
            "mp_backend_name": (c_char_p, []),
            "mp_alloc": (c_void_p, [c_void_p, c_uint64]),
            "mp_free": (c_int, [c_void_p, c_void_p]),
            "mp_owns": (c_int, [c_void_p, c_void_p]),
            "mp_begin_iteration": (None, [c_void_p]),
            "mp_cursor": (c_uint64, [c_void_p]),
            "mp_arena_base": (c_void_p, [c_void_p]),
            "mp_reserve_arena": (c_int, [c_void_p]),
            "mp_get_stats": (None, [c_void_p, POINTER(StatsStruct)]),
            "mp_reset_peaks": (None, [c_void_p]),
            "mp_check": (c_int, [c_void_p, c_char_p, c_uint64]),
            "mp_block_kind": (c_int, [c_void_p, c_void_p]),
            "mp_replay": (
                c_int,
                [c_void_p, POINTER(ctypes.c_int64), c_uint64, POINTER(c_uint64), c_uint64, c_uint64, c_int],
            ),
        }
        if "_cuda" in path.name:  # the CUDA backend, real or built against the fake runtime
            sig["mp_cuda_install"] = (None, [c_void_p, c_int])
            sig["mp_cuda_empty_cache"] = (c_uint64, [])
            sig["mp_cuda_cached_bytes"] = (c_uint64, [])
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)

    def last_error(self) -> str:
        raw = self.mp_last_error()  # type: ignore[attr-defined]
        return raw.decode(errors="replace") if raw else ""


@functools.cache
def load_library(backend: Backend) -> Library:
    """Build (first use) and load the library of `backend` once per process."""
    return Library(library_path(backend))
