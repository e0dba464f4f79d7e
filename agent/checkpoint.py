"""Sharded checkpoints of a wrapped model and optimizer (issue 20): saved per rank, loaded anywhere.

`optimizer.state_dict()` of a wrapped optimizer with sharded chunks all-gathers every rank's shard (a
collective) so rank 0 can save plain PyTorch's whole format. `save_sharded` avoids moving the data: every rank
writes only what it owns (the fp32 master and optimizer state of its shards, as pieces of parameters) to its
own file, and rank 0 adds a small metadata file (world size, the plan's hash, the param groups, the
parameter names in the user's optimizer order, the replicated chunks' values and states, the model's other
state-dict entries). `load_full` assembles plain PyTorch's model and optimizer state dicts from those files in
any process (no process group), and `load_sharded` loads them into a model wrapped at any world size.

Format (directory; every file `torch.save`d, loadable with `weights_only=True`: plain tensors, dicts, lists,
strings, numbers):
  `meta.pt` (rank 0, written last): see `_meta`; `rank<r>.pt` (rank r of N): see `_rank_file`. A piece is one
  parameter's element range held by one file: {"name", "chunk", "start", "end", "shape", "dtype", "master",
  "state"} with `master` the range's values (the fp32 master where the runtime keeps one, never the narrower
  compute copy) and `state` its optimizer state (tensors of the range flat, scalars such as `step` whole).
Every file carries the save's id (`save_id`, rank 0's, broadcast at the start), so files of two saves mixed in
one directory are refused.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from agent.runtime.chunks import ChunkState, views
from agent.runtime.stepper import ChunkStepper

if TYPE_CHECKING:
    from agent.applied import Wrapped

FORMAT = "memplan-sharded-checkpoint"
VERSION = 1
META = "meta.pt"


class CheckpointError(RuntimeError):
    """A sharded checkpoint is missing, unreadable, inconsistent, or does not fit the model it is loaded into."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


# ======================================================================================= save
def save_sharded(wrapped: Wrapped, directory: str | os.PathLike[str]) -> None:
    """Write this rank's shards (and, on rank 0, the metadata) under `directory`. Call it on every rank, after
    `optimizer.step()` (not between backward and step: the host steps run then are speculative). The data needs
    no collective; a broadcast of the save's id at the start and barriers at the end do (so no rank returns
    before every file exists)."""
    if wrapped.unwrapped:
        raise CheckpointError("save_sharded: the model was unwrapped; save it with plain PyTorch")
    runtime = wrapped.runtime
    group = runtime.group
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    runtime.synchronize()
    if any(st.stepped for st in runtime.states):
        raise CheckpointError(
            "save_sharded: called between backward and optimizer.step(): the host optimizer has stepped "
            "speculatively; call it after optimizer.step()"
        )
    save_id = uuid.uuid4().hex
    if group is not None:
        # a collective: called on some ranks only (`if rank == 0: save_sharded(...)`) it raises instead of hanging
        group.check_arrival(
            "agent.checkpoint.save_sharded(wrapped, directory)",
            "Call it on every rank: each writes its own shards.",
            runtime.options.rank_arrival_timeout_s,
            runtime.backwards_started,
        )
        save_id = group.broadcast_object(save_id)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    # the model's state dict on every rank, not only where it is saved: its hook (`_before_state_dict`)
    # evicts the resident chunks, which every rank should do alike
    model_state = wrapped.model.state_dict(keep_vars=True)
    steppers = runtime.steppers
    pieces = [
        p
        for st in runtime.states
        if st.shard is not None
        for p in _pieces(st, steppers[st.index], sharded=True)
    ]
    _atomic_save(
        {
            "format": FORMAT,
            "version": VERSION,
            "save_id": save_id,
            "rank": rank,
            "world_size": world,
            "pieces": pieces,
        },
        out / rank_file(rank),
    )
    _barrier(group)
    if rank == 0:
        _atomic_save(_meta(wrapped, model_state, save_id, world), out / META)
    _barrier(group)


def _barrier(group: Any) -> None:
    if group is not None:
        dist.barrier(group=group.group)


def _atomic_save(obj: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary file next to `path`, then rename: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _cpu(v: Any) -> Any:
    return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v


def _pieces(st: ChunkState, stepper: ChunkStepper, *, sharded: bool) -> list[dict[str, Any]]:
    """What this rank holds of chunk `st`: per parameter piece (its part in this rank's shard, or the whole
    parameter of a replicated chunk), the master values and the optimizer state."""
    assert st.master is not None
    out: list[dict[str, Any]] = []
    whole = st.spec.entries
    if sharded:
        assert st.shard is not None
        for i, j in enumerate(stepper.positions):
            piece, e = stepper.entries[i], whole[j]
            start = piece.offset + st.shard.start - e.offset  # where the piece starts inside the parameter
            out.append(
                _piece(e.name, st.index, start, start + piece.numel, e.shape, stepper.masters[i], stepper, j)
            )
        return out
    for j, (e, v) in enumerate(zip(whole, views(st.master, whole), strict=True)):
        out.append(_piece(e.name, st.index, 0, e.numel, e.shape, v, stepper, j))
    return out


def _piece(
    name: str,
    chunk: int,
    start: int,
    end: int,
    shape: torch.Size,
    master: torch.Tensor,
    stepper: ChunkStepper,
    j: int,
) -> dict[str, Any]:
    state = stepper.param_state(j) or {}
    return {
        "name": name,
        "chunk": chunk,
        "start": start,
        "end": end,
        "shape": list(shape),
        "dtype": str(master.dtype).removeprefix("torch."),
        "master": _cpu(master).reshape(-1),
        "state": {
            k: (_cpu(v).reshape(-1) if _is_flat(v, end - start) else _cpu(v)) for k, v in state.items()
        },
    }


def _is_flat(v: Any, n: int) -> bool:
    """A per-element state value of a piece of n elements (moments, momentum), not a scalar such as `step`."""
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == n


def _meta(wrapped: Wrapped, model_state: dict[str, Any], save_id: str, world: int) -> dict[str, Any]:
    runtime = wrapped.runtime
    layout = runtime.layout
    optimizer = wrapped.optimizer
    names: list[str] = []
    groups: list[dict[str, Any]] = []
    for g in optimizer.param_groups:
        indices = []
        for p in g["params"]:
            entry = layout.entry(p)
            assert entry is not None  # `wrap` refuses an optimizer holding other parameters
            indices.append(len(names))
            names.append(entry.name)
        groups.append({**{k: _cpu(v) for k, v in g.items() if k != "params"}, "params": indices})
    aliases: dict[str, str] = {}
    others: dict[str, torch.Tensor] = {}
    keys: list[str] = []
    for key, value in model_state.items():
        keys.append(key)
        entry = layout.entry(value)
        if entry is not None:
            aliases[key] = entry.name
        else:
            others[key] = _cpu(value)
    params = {
        e.name: {"shape": list(e.shape), "chunk": e.chunk, "sharded": layout.chunks[e.chunk].sharded}
        for e in layout.by_param.values()
    }
    steppers = runtime.steppers
    replicated = [
        p for st in runtime.states if st.shard is None for p in _pieces(st, steppers[st.index], sharded=False)
    ]
    source = wrapped.source
    return {
        "format": FORMAT,
        "version": VERSION,
        "save_id": save_id,
        "world_size": world,
        "plan_hash": wrapped.plan.content_hash(),
        "plan_id": (source.plan_id if source is not None else None) or "",
        "param_groups": groups,
        "param_names": names,
        "params": params,
        "state_dict_keys": keys,
        "aliases": aliases,
        "others": others,
        "replicated": replicated,
    }


# ======================================================================================= load
def _read(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({what} of a sharded checkpoint)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        raise CheckpointError(f"{path}: unreadable ({what} of a sharded checkpoint): {exc}") from exc
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a memplan sharded checkpoint file")
    if obj.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {obj.get('version')!r}, this memplan reads {VERSION}")
    return obj


def load_full(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Plain PyTorch's model and optimizer state dicts from a sharded checkpoint, in any process (no process
    group): `model.load_state_dict(m)` (keys as the saved model's `state_dict()`, tied parameters under every
    name) and `optimizer.load_state_dict(o)` (torch's format, indices in the user's optimizer order) continue
    the training. Every file is read and checked before anything is returned: a missing, unreadable or
    inconsistent file raises `CheckpointError` naming it."""
    root = Path(directory)
    meta_path = root / META
    meta = _read(meta_path, "metadata")
    world = int(meta["world_size"])
    params: dict[str, dict[str, Any]] = meta["params"]
    values: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    flat_states: dict[str, dict[str, torch.Tensor]] = {}
    state_covered: dict[str, dict[str, torch.Tensor]] = {}
    others: dict[str, dict[str, Any]] = {}
    sources: list[tuple[Path, list[dict[str, Any]]]] = [(meta_path, meta["replicated"])]
    for r in range(world):
        path = root / rank_file(r)
        f = _read(path, f"rank {r} of {world}")
        if f.get("save_id") != meta["save_id"] or f.get("rank") != r or f.get("world_size") != world:
            raise CheckpointError(
                f"{path}: belongs to another save (save {f.get('save_id')!r}, rank {f.get('rank')} of "
                f"{f.get('world_size')}; {meta_path} is save {meta['save_id']!r} of {world} ranks)"
            )
        sources.append((path, f["pieces"]))
    for path, pieces in sources:
        for piece in pieces:
            name, start, end = piece["name"], int(piece["start"]), int(piece["end"])
            info = params.get(name)
            numel = math.prod(info["shape"]) if info is not None else -1
            master: torch.Tensor = piece["master"]
            if info is None or not 0 <= start < end <= numel or master.numel() != end - start:
                raise CheckpointError(
                    f"{path}: piece {name!r} [{start}, {end}) does not fit the saved parameters"
                )
            if name not in values:
                values[name] = torch.zeros(numel, dtype=master.dtype)
                covered[name] = torch.zeros(numel, dtype=torch.bool)
            if covered[name][start:end].any():
                raise CheckpointError(
                    f"{path}: piece {name!r} [{start}, {end}) overlaps another file's piece"
                )
            values[name][start:end] = master
            covered[name][start:end] = True
            for k, v in piece["state"].items():
                if _is_flat(v, end - start):
                    full = flat_states.setdefault(name, {}).get(k)
                    if full is None:
                        full = flat_states[name][k] = torch.zeros(numel, dtype=v.dtype)
                        state_covered.setdefault(name, {})[k] = torch.zeros(numel, dtype=torch.bool)
                    full[start:end] = v
                    state_covered[name][k][start:end] = True
                else:
                    others.setdefault(name, {}).setdefault(k, v)  # the lowest rank's (all ranks agree)
    for name, info in params.items():
        if name not in covered or not bool(covered[name].all()):
            n = int(covered[name].sum()) if name in covered else 0
            raise CheckpointError(
                f"{root}: parameter {name!r}: the files hold {n} of its {math.prod(info['shape'])} elements "
                f"(a rank file of another save or world size?)"
            )
        for k, c in state_covered.get(name, {}).items():
            if not bool(c.all()):
                raise CheckpointError(
                    f"{root}: optimizer state {k!r} of parameter {name!r}: some ranks lack it"
                )
    model: dict[str, torch.Tensor] = {}
    for key in meta["state_dict_keys"]:
        name = meta["aliases"].get(key)
        if name is None:
            model[key] = meta["others"][key]
        else:
            model[key] = values[name].view(params[name]["shape"])
    state: dict[int, dict[str, Any]] = {}
    for idx, name in enumerate(meta["param_names"]):
        shape = params[name]["shape"]
        st: dict[str, Any] = dict(others.get(name, {}))
        for k, full in flat_states.get(name, {}).items():
            st[k] = full.view(shape)
        if st:
            state[idx] = st
    return model, {"state": state, "param_groups": meta["param_groups"]}


def load_sharded(wrapped: Wrapped, directory: str | os.PathLike[str]) -> None:
    """Load a sharded checkpoint (saved at any world size) into a model wrapped at this job's world size. Call
    it on every rank. Each rank reads every file and builds the whole state dicts (`load_full`), then goes
    through the wrapped model's and optimizer's `load_state_dict`, which keep this rank's shard: simple and
    exact, at the cost of every rank reading (and briefly holding) the whole checkpoint. In mixed precision
    the fp32 masters are set from the saved fp32 values (not from the model's bf16 compute copy). Everything
    is read and checked against the wrapped model and optimizer before any of it is loaded: a bad file
    leaves them as they were."""
    if wrapped.unwrapped:
        raise CheckpointError("load_sharded: the model was unwrapped; load into it with plain PyTorch")
    model_sd, optim_sd = load_full(directory)
    current = wrapped.model.state_dict(keep_vars=True)  # keys and shapes only: no copy of the model
    if current.keys() != model_sd.keys():
        missing = sorted(current.keys() - model_sd.keys())[:5]
        unexpected = sorted(model_sd.keys() - current.keys())[:5]
        raise CheckpointError(
            f"{directory}: the saved model's state-dict keys differ from this model's (missing {missing}, "
            f"unexpected {unexpected})"
        )
    for key, value in model_sd.items():
        if value.shape != current[key].shape:
            raise CheckpointError(
                f"{directory}: {key!r} has shape {list(value.shape)}, this model's {list(current[key].shape)}"
            )
    groups = wrapped.optimizer.param_groups
    saved = optim_sd["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in groups]:
        raise CheckpointError(
            f"{directory}: the saved optimizer's param groups hold {[len(g['params']) for g in saved]} "
            f"parameters, this optimizer's {[len(g['params']) for g in groups]}"
        )
    wrapped.model.load_state_dict(model_sd)
    _load_masters(wrapped, model_sd)
    wrapped.optimizer.load_state_dict(optim_sd)  # then rebuilds the compute copies from the masters


@torch.no_grad()
def _load_masters(wrapped: Wrapped, model_sd: dict[str, torch.Tensor]) -> None:
    """Mixed precision: the model's `load_state_dict` went through the narrower compute copy, so set every
    fp32 master (this rank's piece of it) from the saved full-precision value."""
    runtime = wrapped.runtime
    if not any(st.mixed for st in runtime.states):
        return
    done: set[int] = set()
    for key, value in wrapped.model.state_dict(keep_vars=True).items():
        entry = runtime.layout.entry(value)
        if entry is None or id(entry.param) in done or not runtime.states[entry.chunk].mixed:
            continue
        done.add(id(entry.param))
        stepper = runtime.steppers[entry.chunk]
        stepper.load_master(stepper.state.spec.entries.index(entry), model_sd[key])
