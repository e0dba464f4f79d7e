"""An ordered set of (int64, int64) keys for compiled code: a treap in flat arrays, O(log n) expected per operation.

numba has no sorted container, and the large-trace paths (sweep best fit, the validator) need one whose
size reaches the number of simultaneously live buffers (10^5 on deep traces), where a sorted array with
shifting inserts would cost O(n) per event. Nodes are preallocated slots `0..capacity-1`; a slot is
a key (`k1[i]`, `k2[i]`, compared lexicographically) and a random priority; the tree is a max-heap on
priorities and a binary search tree on keys (Seidel & Aragon 1996).
Insertion descends and rotates the new node up; removal rotates the node down to a leaf and detaches
it (parent pointers, no recursion): O(log n) expected, O(1) expected rotations. Callers own the slot
numbering (typically slot = buffer index), so a key is removed by its slot without a search.

Every function is `njit(cache=True, nogil=True)`; `root` is a one-element array so functions can update it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NIL = -1


def new_treap(capacity: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """(k1, k2, pri, left, right, parent, root) arrays for an empty treap of at most `capacity` nodes."""
    rng = np.random.default_rng(seed)
    return (
        np.zeros(capacity, dtype=np.int64),
        np.zeros(capacity, dtype=np.int64),
        rng.integers(0, 1 << 62, size=capacity, dtype=np.int64),
        np.full(capacity, NIL, dtype=np.int64),
        np.full(capacity, NIL, dtype=np.int64),
        np.full(capacity, NIL, dtype=np.int64),
        np.full(1, NIL, dtype=np.int64),
    )


@njit(cache=True, nogil=True)
def _less(k1, k2, i, a, b):  # type: ignore[no-untyped-def]
    """Key of node i < (a, b)."""
    return k1[i] < a or (k1[i] == a and k2[i] < b)


@njit(cache=True, nogil=True)
def _rotate_up(left, right, parent, root, x):  # type: ignore[no-untyped-def]
    """Rotate x above its parent, keeping the key order."""
    p = parent[x]
    g = parent[p]
    if left[p] == x:
        c = right[x]
        left[p] = c
        right[x] = p
    else:
        c = left[x]
        right[p] = c
        left[x] = p
    if c != NIL:
        parent[c] = p
    parent[p] = x
    parent[x] = g
    if g == NIL:
        root[0] = x
    elif left[g] == p:
        left[g] = x
    else:
        right[g] = x


@njit(cache=True, nogil=True)
def treap_insert(k1, k2, pri, left, right, parent, root, node, a, b):  # type: ignore[no-untyped-def]
    """Insert slot `node` with key (a, b); the key must not be present."""
    k1[node] = a
    k2[node] = b
    left[node] = NIL
    right[node] = NIL
    t = root[0]
    p = NIL
    go_left = False
    while t != NIL:
        p = t
        go_left = not _less(k1, k2, t, a, b)
        t = left[t] if go_left else right[t]
    parent[node] = p
    if p == NIL:
        root[0] = node
        return
    if go_left:
        left[p] = node
    else:
        right[p] = node
    while parent[node] != NIL and pri[node] > pri[parent[node]]:
        _rotate_up(left, right, parent, root, node)


@njit(cache=True, nogil=True)
def treap_remove(k1, k2, pri, left, right, parent, root, node):  # type: ignore[no-untyped-def]
    """Remove slot `node` (which must be in the treap)."""
    while left[node] != NIL or right[node] != NIL:
        lc = left[node]
        rc = right[node]
        c = lc if rc == NIL or (lc != NIL and pri[lc] > pri[rc]) else rc
        _rotate_up(left, right, parent, root, c)
    p = parent[node]
    if p == NIL:
        root[0] = NIL
    elif left[p] == node:
        left[p] = NIL
    else:
        right[p] = NIL
    parent[node] = NIL


@njit(cache=True, nogil=True)
def treap_ceiling(k1, k2, left, right, root, a, b):  # type: ignore[no-untyped-def]
    """Slot of the smallest key >= (a, b), or NIL."""
    t = root[0]
    best = NIL
    while t != NIL:
        if _less(k1, k2, t, a, b):
            t = right[t]
        else:
            best = t
            t = left[t]
    return best


@njit(cache=True, nogil=True)
def treap_floor_below(k1, k2, left, right, root, a, b):  # type: ignore[no-untyped-def]
    """Slot of the largest key < (a, b), or NIL."""
    t = root[0]
    best = NIL
    while t != NIL:
        if _less(k1, k2, t, a, b):
            best = t
            t = right[t]
        else:
            t = left[t]
    return best
