"""Chunk layout: which parameter lives in which chunk at which offset, checked against the model.

The plan names parameters as `model.named_parameters()` does (a tied parameter may be named by any of
its aliases) and packs them, in the listed order, into chunks of `chunk_size_bytes`, each parameter at a
16-byte aligned offset (`client.contract.parameter_slot_bytes`, the function the planner counts chunk
bytes with). Bytes are counted in the training (compute) dtype. A plan that does not match the model is refused
with an error naming the chunk and the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from client.contract import Placement, Policy, parameter_slot_bytes, shard_elements


def hooked_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a module's forward hooks make resident (or gather) before it runs: its own, and those of
    submodules its forward uses without calling them. Torch's `nn.MultiheadAttention` passes `out_proj.weight`
    and `.bias` to `F.multi_head_attention_forward`; the `out_proj` Linear's own forward never runs, so its
    hooks never fire (session 21: with out_proj in another chunk than `in_proj_weight` and one buffer, the
    attention read out_proj's host copy, correct by accident on a CPU, a device mismatch on a GPU). Likewise
    the parameters of submodules that cannot run at all (no forward of their own: `nn.ParameterList`,
    `nn.ParameterDict`, a bare `nn.Module` holding parameters), reached through such submodules only: only this
    module's forward can read them (session 26: a parent reading `self.aux.scale` of an offloaded chunk raced
    the prefetch writing that buffer, under the stream checker; on a GPU, a device mismatch when not resident)."""
    params = [p for p in module._parameters.values() if p is not None]
    if isinstance(module, nn.MultiheadAttention):
        params += [p for p in module.out_proj._parameters.values() if p is not None]
    inert = [c for c in module.children() if _cannot_run(c)]
    while inert:
        child = inert.pop()
        params += [p for p in child._parameters.values() if p is not None]
        inert += [c for c in child.children() if _cannot_run(c)]
    return list({id(p): p for p in params}.values())


def _cannot_run(module: nn.Module) -> bool:
    """The module has no forward of its own (calling it raises): a container of parameters or modules."""
    return type(module).forward is nn.Module.forward


class PlanMismatchError(ValueError):
    """The plan's chunk layout does not describe this model."""


@dataclass(frozen=True)
class ParamEntry:
    """One parameter's place: chunk, element offset and length inside the chunk's flat buffer."""

    name: str
    param: nn.Parameter
    chunk: int
    offset: int  # elements of the compute dtype from the start of the chunk
    numel: int
    shape: torch.Size

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class ChunkSpec:
    index: int
    placement: Placement
    entries: list[ParamEntry] = field(default_factory=list)
    # elements the chunk's buffers hold, alignment padding included (set by `ChunkLayout.from_policy`);
    # None: the entries are packed back to back (layouts the profiler's probes build) and end at the last one
    padded_numel: int | None = None
    # sharded chunk (issue 20; offloaded: ZeRO-2 on the host, persistent: on the device, `device_shards.py`):
    # elements each rank owns (see `shards.py`); 0: replicated
    shard_numel: int = 0

    @property
    def sharded(self) -> bool:
        return self.shard_numel > 0

    @property
    def used_numel(self) -> int:
        if self.padded_numel is not None:
            return self.padded_numel
        return self.entries[-1].end if self.entries else 0

    @property
    def offloaded(self) -> bool:
        return self.placement == Placement.offloaded


@dataclass
class ChunkLayout:
    chunk_numel: int  # capacity of every chunk, in elements of the compute dtype
    compute_dtype: torch.dtype
    chunks: list[ChunkSpec]
    n_buffers: int
    by_param: dict[int, ParamEntry]  # id(parameter) -> entry
    world_size: int = 1  # ranks the plan was made for: sharded chunks are cut into this many shards

    @property
    def sharded(self) -> list[ChunkSpec]:
        return [c for c in self.chunks if c.sharded]

    @property
    def buffer_numel(self) -> int:
        """Elements of each device buffer: a chunk's capacity, or a sharded chunk's zero-padded flat size
        (world_size shards, a few elements past the capacity at most) where that is larger: the gradient
        area is reduce-scattered whole."""
        return max(
            [self.chunk_numel, *(c.shard_numel * self.world_size for c in self.sharded if c.offloaded)]
        )

    @property
    def offloaded(self) -> list[ChunkSpec]:
        return [c for c in self.chunks if c.offloaded]

    @property
    def persistent(self) -> list[ChunkSpec]:
        return [c for c in self.chunks if not c.offloaded]

    def entry(self, param: torch.Tensor) -> ParamEntry | None:
        return self.by_param.get(id(param))

    @classmethod
    def from_policy(cls, policy: Policy, model: nn.Module, compute_dtype: torch.dtype) -> ChunkLayout:
        """Check `policy` against `model` and compute every parameter's offset. Raises PlanMismatchError."""
        model_name = type(model).__name__
        named: dict[str, nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        canonical: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
        esize = compute_dtype.itemsize
        if policy.chunk_size_bytes % esize:
            raise PlanMismatchError(
                f"policy.chunk_size_bytes: {policy.chunk_size_bytes} is not a multiple of the "
                f"{compute_dtype} element size {esize}"
            )
        chunk_numel = policy.chunk_size_bytes // esize
        placed: dict[int, str] = {}  # id(param) -> "chunks[i].parameters[j]"
        by_param: dict[int, ParamEntry] = {}
        chunks: list[ChunkSpec] = []
        for ci, chunk in enumerate(policy.chunks):
            spec = ChunkSpec(index=ci, placement=chunk.placement)
            offset = 0
            for pj, name in enumerate(chunk.parameters):
                where = f"policy.chunks[{ci}].parameters[{pj}]"
                param = named.get(name)
                if param is None:
                    raise PlanMismatchError(f"{where}: {name!r} is not a parameter of this {model_name}")
                if id(param) in placed:
                    raise PlanMismatchError(
                        f"{where}: {name!r} is the parameter already placed at {placed[id(param)]} "
                        f"(a tied parameter must be listed once)"
                    )
                placed[id(param)] = where
                if not param.is_floating_point():
                    raise PlanMismatchError(
                        f"{where}: {name!r} has dtype {param.dtype}; chunks hold floats only"
                    )
                slot = parameter_slot_bytes(param.numel(), esize) // esize
                if offset + slot > chunk_numel:
                    raise PlanMismatchError(
                        f"{where}: {name!r} ({slot * esize} bytes with alignment) overflows the chunk: "
                        f"{offset * esize} bytes already used of chunk_size_bytes {policy.chunk_size_bytes}"
                    )
                entry = ParamEntry(
                    name=canonical.get(id(param), name),
                    param=param,
                    chunk=ci,
                    offset=offset,
                    numel=param.numel(),
                    shape=param.shape,
                )
                spec.entries.append(entry)
                by_param[id(param)] = entry
                offset += slot
            spec.padded_numel = offset
            if chunk.sharded:
                spec.shard_numel = shard_elements(offset, policy.world_size)
            if offset * esize != chunk.used_bytes:
                raise PlanMismatchError(
                    f"policy.chunks[{ci}].used_bytes: is {chunk.used_bytes}, but its parameters take "
                    f"{offset * esize} bytes in {compute_dtype} with 16-byte alignment (was the plan solved for another "
                    "precision, or by a planner without parameter alignment?)"
                )
            chunks.append(spec)
        missing = [n for n, p in model.named_parameters() if id(p) not in placed]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            raise PlanMismatchError(
                f"policy.chunks: {len(missing)} parameter(s) of this {model_name} are in no chunk, e.g. {shown}"
            )
        for path, module in model.named_modules():
            needed = {
                by_param[id(p)].chunk
                for p in hooked_parameters(module)
                if chunks[by_param[id(p)].chunk].offloaded
            }
            if len(needed) > policy.n_buffers:
                raise PlanMismatchError(
                    f"policy.n_buffers: module {path or '<root>'} ({type(module).__name__}) needs "
                    f"{len(needed)} offloaded chunks {sorted(needed)} resident at once, more than the "
                    f"{policy.n_buffers} buffer(s)"
                )
        return cls(
            chunk_numel=chunk_numel,
            compute_dtype=compute_dtype,
            chunks=chunks,
            n_buffers=policy.n_buffers,
            by_param=by_param,
            world_size=policy.world_size,
        )


def check_world(layout: ChunkLayout, world_size: int) -> None:
    """A layout with sharded chunks must run at the world size its shards were cut for (one shard per rank)."""
    if layout.sharded and layout.world_size != world_size:
        c = layout.sharded[0].index
        raise PlanMismatchError(
            f"policy.world_size: is {layout.world_size}, and policy.chunks[{c}] is sharded into that many shards, "
            f"but this job runs {world_size} process(es): solve the plan for this world size"
        )
