"""Chunk grid: pack a trace's parameters, in execution order, into equal-size chunks without splitting a block.

`ChunkGrid` is the solver's view (which parameters share a chunk); the runtime's placement of
parameters in chunk buffers is a different thing, `agent.runtime.layout.ChunkLayout`.

A layout is the part of the policy that fixes *which* parameters share a chunk; whether each chunk is
persistent or offloaded is decided later by a solver. Rules:

- Parameters keep the trace's order exactly (`trace.model.parameters`), so chunks are contiguous runs.
- A parameter takes its 16-byte aligned slot (`slot_bytes`, the contract's `parameter_slot_bytes`): chunk
  bytes here equal the runtime's chunk buffers byte for byte.
- A block's parameters never straddle two chunks. The chunk-size grid never offers a size below the
  largest block, so the "a single block exceeds the chunk size" case cannot arise: the smallest
  candidate is "one block per chunk" (the largest block's bytes, rounded up to `CHUNK_ALIGN_BYTES`).
- A block without parameters belongs to no chunk (`Chunk.blocks` lists only owners of parameters);
  for timing it runs inside the window of the chunk that holds the latest block before it (chunk 0 if none).
"""

from __future__ import annotations

from dataclasses import dataclass

from client.contract import ParameterInfo, Trace, parameter_slot_bytes

MiB = 2**20
CHUNK_ALIGN_BYTES = 1 * MiB
# ProTrain-style grid of chunk sizes (bytes of the compute copy); sizes below the largest block are dropped.
CHUNK_SIZE_GRID: tuple[int, ...] = (32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB)


@dataclass(frozen=True)
class ChunkGrid:
    """Chunks as runs of blocks; `param_ranges[c]` is the slice of `trace.model.parameters` in chunk c."""

    chunk_size_bytes: int
    chunk_blocks: tuple[tuple[int, ...], ...]  # blocks owning parameters in each chunk
    param_ranges: tuple[tuple[int, int], ...]  # [start, stop) into trace.model.parameters
    used_bytes: tuple[int, ...]
    chunk_of_block: tuple[int, ...]  # timing window of every block (see module docstring)

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_blocks)

    @property
    def padding_bytes(self) -> int:
        """Simulated padding waste: allocated chunk bytes minus parameter bytes."""
        return self.n_chunks * self.chunk_size_bytes - sum(self.used_bytes)

    @property
    def partition(self) -> tuple[tuple[int, ...], ...]:
        return self.chunk_blocks


def slot_bytes(p: ParameterInfo) -> int:
    """Bytes parameter `p` takes in a chunk: its bytes rounded up to the runtime's 16-byte alignment (the
    contract's `parameter_slot_bytes`, which the runtime lays chunks out with)."""
    return parameter_slot_bytes(p.numel, p.bytes // p.numel) if p.numel else 0


def block_runs(trace: Trace) -> list[tuple[int, int, int]]:
    """(block, first parameter index, stop index) for each block that owns parameters, in order.

    Raises ValueError naming the parameter row when a block's parameters are not contiguous in
    execution order (the layout could not keep the block in one chunk and the runtime's order at once).
    """
    runs: list[tuple[int, int, int]] = []
    params = trace.model.parameters
    for i, p in enumerate(params):
        if runs and runs[-1][0] == p.block:
            runs[-1] = (p.block, runs[-1][1], i + 1)
            continue
        if runs and p.block < runs[-1][0]:
            raise ValueError(
                f"model.parameters[{i}].block: {p.block} comes after block {runs[-1][0]}; parameters must be "
                "listed in execution order with each block's parameters contiguous"
            )
        runs.append((p.block, i, i + 1))
    return runs


def _align(n: int) -> int:
    return max(CHUNK_ALIGN_BYTES, -(-n // CHUNK_ALIGN_BYTES) * CHUNK_ALIGN_BYTES)


def pack(trace: Trace, chunk_size_bytes: int) -> ChunkGrid:
    """Greedy packing in execution order: a new chunk starts when the next block would overflow the current one."""
    runs = block_runs(trace)
    params = trace.model.parameters
    sizes = {b: sum(slot_bytes(p) for p in params[s:e]) for b, s, e in runs}
    biggest = max(sizes.values(), default=0)
    if biggest > chunk_size_bytes:
        raise ValueError(
            f"chunk_size_bytes: {chunk_size_bytes} is smaller than block {max(sizes, key=sizes.__getitem__)} "
            f"({biggest} bytes); a block is never split across chunks"
        )
    chunks: list[list[int]] = []
    ranges: list[list[int]] = []
    used: list[int] = []
    for b, s, e in runs:
        if chunks and used[-1] + sizes[b] <= chunk_size_bytes:
            chunks[-1].append(b)
            ranges[-1][1] = e
            used[-1] += sizes[b]
        else:
            chunks.append([b])
            ranges.append([s, e])
            used.append(sizes[b])
    owner = {b: c for c, bs in enumerate(chunks) for b in bs}
    chunk_of_block: list[int] = []
    current = 0
    for b in range(len(trace.model.blocks)):
        current = owner.get(b, current)
        chunk_of_block.append(current)
    return ChunkGrid(
        chunk_size_bytes=chunk_size_bytes,
        chunk_blocks=tuple(tuple(c) for c in chunks),
        param_ranges=tuple((r[0], r[1]) for r in ranges),
        used_bytes=tuple(used),
        chunk_of_block=tuple(chunk_of_block),
    )


def candidate_layouts(trace: Trace, max_candidates: int | None = None) -> list[ChunkGrid]:
    """Distinct layouts from the grid plus "one block per chunk", fewest padding bytes first.

    Sizes that produce the same block partition as a smaller size are dropped (same decisions, more
    padding: never better). `max_candidates` keeps the first ones by padding waste, ProTrain's criterion.
    """
    params = trace.model.parameters
    if not params:
        return [pack(trace, CHUNK_ALIGN_BYTES)]
    per_block: dict[int, int] = {}
    for p in params:
        per_block[p.block] = per_block.get(p.block, 0) + slot_bytes(p)
    one_block = _align(max(per_block.values()))
    sizes = sorted({one_block, *(s for s in CHUNK_SIZE_GRID if s >= one_block)})
    seen: set[tuple[tuple[int, ...], ...]] = set()
    layouts: list[ChunkGrid] = []
    for s in sizes:
        lay = pack(trace, s)
        if lay.partition in seen:
            continue
        seen.add(lay.partition)
        layouts.append(lay)
    layouts.sort(key=lambda lay: (lay.padding_bytes, lay.chunk_size_bytes))
    return layouts[:max_candidates] if max_candidates else layouts


def layout_from_chunks(trace: Trace, chunk_size_bytes: int, chunk_parameters: list[list[str]]) -> ChunkGrid:
    """Rebuild the layout of an existing policy, checking it against the trace (errors name the chunk)."""
    params = trace.model.parameters
    names = [n for chunk in chunk_parameters for n in chunk]
    expected = [p.name for p in params]
    if names != expected:
        for i, (got, want) in enumerate(zip(names, expected, strict=False)):
            if got != want:
                raise ValueError(f"policy.chunks: parameter #{i} is {got!r}, the trace has {want!r} there")
        raise ValueError(f"policy.chunks: list {len(names)} parameters, the trace has {len(expected)}")
    runs = block_runs(trace)
    start_of = {s: b for b, s, _ in runs}
    chunks: list[tuple[int, ...]] = []
    ranges: list[tuple[int, int]] = []
    used: list[int] = []
    pos = 0
    for c, chunk in enumerate(chunk_parameters):
        stop = pos + len(chunk)
        if pos not in start_of and chunk:
            raise ValueError(
                f"policy.chunks[{c}]: starts inside block {params[pos].block}; a block is never split"
            )
        blocks = tuple(sorted({params[i].block for i in range(pos, stop)}))
        ranges.append((pos, stop))
        chunks.append(blocks)
        used.append(sum(slot_bytes(params[i]) for i in range(pos, stop)))
        if used[-1] > chunk_size_bytes:
            raise ValueError(f"policy.chunks[{c}]: holds {used[-1]} bytes, more than chunk_size_bytes")
        pos = stop
    owner = {b: c for c, bs in enumerate(chunks) for b in bs}
    chunk_of_block: list[int] = []
    current = 0
    for b in range(len(trace.model.blocks)):
        current = owner.get(b, current)
        chunk_of_block.append(current)
    return ChunkGrid(chunk_size_bytes, tuple(chunks), tuple(ranges), tuple(used), tuple(chunk_of_block))


def module_of(name: str) -> str:
    """The module path owning parameter `name` ("" for a parameter of the root module)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def co_needed_chunks(trace: Trace, layout: ChunkGrid) -> tuple[tuple[int, ...], ...]:
    """Sets of chunks that one module needs resident at once, where a module spans more than one chunk.

    The runtime uploads every offloaded chunk holding one of a module's own parameters before the module
    runs, and refuses a plan where a module needs more offloaded chunks than there are buffers
    (`agent.runtime.layout.ChunkLayout.from_policy`). Chunks are cut between blocks, so a module spans two
    chunks only through a tied parameter: a masked LM's decoder whose weight is the word embedding (the
    first chunk) and whose bias lives in the last. A module's parameters are the names one component below
    its path, aliases included. Every solver keeps, for each set here, its offloaded chunks within
    `n_buffers` (`PolicyInstance.min_buffers`). Sorted and distinct; empty for models without such modules.
    """
    params = trace.model.parameters
    chunks_of: dict[str, set[int]] = {}
    for c, (start, stop) in enumerate(layout.param_ranges):
        for p in params[start:stop]:
            for name in (p.name, *p.aliases):
                chunks_of.setdefault(module_of(name), set()).add(c)
    return tuple(sorted({tuple(sorted(cs)) for cs in chunks_of.values() if len(cs) > 1}))
