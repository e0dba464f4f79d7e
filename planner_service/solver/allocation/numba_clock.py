"""The wall clock inside numba-compiled code, for the solvers' deadline checks."""

from __future__ import annotations

import time

import numba
from numba import njit


@njit(cache=True)
def now() -> float:
    """`time.perf_counter()` from compiled code (briefly takes the GIL back through numba's object mode)."""
    with numba.objmode(t="float64"):
        t = time.perf_counter()
    return t
