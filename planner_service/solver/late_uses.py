"""Chunks used again in a later window: a tied parameter's chunk re-uploaded, and what it displaces.

GPT-2's `lm_head` shares `transformer.wte.weight`, which lives in chunk 0: the epilogue, in the last window,
needs chunk 0 again. The runtime demands chunks in the order the first iteration recorded
(`agent.runtime.schedule.AccessSchedule`: forward `0, 1, ..., C-1, 0`; backward `0, C-1, ..., 1, 0`) and
prefetches the next ones into the buffer of the resident chunk used furthest ahead (Belady's rule), which is
the tied chunk itself. So, when the tied chunk is not among the chunks still in a buffer after forward (the
last `n_buffers` offloaded ones; `cost_model.residency`):

- forward: it is uploaded a second time for its late window (demanded there, so with one buffer the upload is
  serial with that window's compute);
- backward: it is resident when backward starts (its late window runs first), in the place of the first of
  the chunks the residency rule leaves resident, which is then uploaded again in its own backward window. The
  tied chunk itself is evicted by the next prefetch and uploaded again in its own window, as any chunk that is
  not resident after forward.

On the development machine (CPU, 2 ranks, GPT-2 with 5 offloaded chunks and one buffer) the runtime made 11
uploads per iteration where the model without these terms counted 9 (session 16). The model charges one
re-upload per (chunk, later window) pair and one displacement however many tied chunks there are: exact for
the tied word embedding; several tied chunks, or several later windows of one, may make the runtime upload
more than that.
"""

from __future__ import annotations

from client.contract import Trace
from planner_service.solver.chunk_grid import ChunkGrid
from planner_service.solver.held_gradients import last_use


def late_use_windows(trace: Trace, layout: ChunkGrid) -> tuple[tuple[int, int], ...]:
    """(chunk, window) pairs, window > chunk: a parameter of the chunk is used by a block timed in that later
    window (`ParameterInfo.use_blocks`; a trace without it: the last use its aliases name,
    `held_gradients.last_use`). Sorted and distinct; empty for models without tied or shared parameters."""
    params = trace.model.parameters
    blocks = trace.model.blocks
    pairs: set[tuple[int, int]] = set()
    for c, (start, stop) in enumerate(layout.param_ranges):
        for p in params[start:stop]:
            uses = p.use_blocks or [p.block, last_use(blocks, p)]
            for u in uses:
                w = layout.chunk_of_block[u]
                if w > c:
                    pairs.add((c, w))
    return tuple(sorted(pairs))


def late_uploads(
    late_uses: tuple[tuple[int, int], ...],
    upload: list[int] | tuple[int, ...],
    need: list[bool],
    windows: int,
) -> list[int]:
    """Per window: the time of uploading again the tied chunks it uses that are not in a buffer after forward
    (`need`), at the per-chunk `upload` times."""
    late = [0] * windows
    for c, w in late_uses:
        if need[c]:
            late[w] += int(upload[c])
    return late


def displaced_chunk(
    late_uses: tuple[tuple[int, int], ...], need: list[bool], resident: list[bool]
) -> int | None:
    """The chunk a re-uploaded tied chunk displaces from the buffers for backward: the first `resident` one
    after forward, when some tied chunk is not (`need`); else None."""
    if not any(need[c] for c, _ in late_uses):
        return None
    return next((c for c, r in enumerate(resident) if r), None)
