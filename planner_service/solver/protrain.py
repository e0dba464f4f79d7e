"""ProTrain's baseline search: exhaustive over its four knobs, scored by the shared cost model.

Knobs (arXiv 2406.08334, Sec. 3.4): n_persist (a prefix of chunks stays on the device), n_buffer (device
buffers for the offloaded rest, at least `PolicyInstance.min_buffers`: the runtime's floor when a module spans
chunks), n_swap and n_checkpoint (repeated blocks, laid out from the first block:
swap and checkpoint blocks interleaved early, unoptimised blocks last; the prologue and epilogue are kept).
In a multi-rank job (issue 20) the offloaded chunks are sharded (ZeRO-Offload style: each rank steps its share
of their host states) and the persistent prefix is tried replicated and, where the instance has the terms,
sharded on the device (ZeRO-3: `agent/runtime/device_shards.py`; its shards, two gathered copies, the exposed
all-gathers); every
setting is timed and sized by the same multi-rank cost model (one node: node-shared compute copies, one
barrier per step; several nodes: private copies all-gathered at step(); `sharding.py`).

The search is exhaustive in effect, with two exact pruning rules (each switchable for ablation):
- `prune_memory`: knob settings whose peak device or host bytes exceed the limits are skipped without
  timing them (activation peaks of every (n_swap, n_checkpoint) pair are computed once, vectorised).
- `prune_bound`: an (n_persist, n_buffer) pair is skipped when even keeping every block (the fastest mode
  setting: checkpointing only adds recompute, swapping only adds copies) is no faster than the best found,
  and a whole n_persist is skipped when that holds with the most buffers that fit (more buffers are never
  slower);
  within a pair, settings whose lower bound (compute + recompute + device optimizer) reaches the best time
  are dropped, and the rest are timed together (`cost_model.BatchTimer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner_service.solver.cost_model import BatchTimer, Cost, evaluate_decision
from planner_service.solver.instance import Decision, Mode, PolicyInstance


@dataclass(frozen=True)
class ProTrainResult:
    decision: Decision | None
    cost: Cost | None
    evaluated: int  # knob settings timed by the cost model


def knob_modes(n_blocks: int, repeated: list[int], n_swap: int, n_ckpt: int) -> tuple[Mode, ...]:
    """ProTrain's block layout: S C S C ... (interleaved from the first repeated block), then keep."""
    seq: list[Mode] = []
    s, c = n_swap, n_ckpt
    while s or c:
        if s:
            seq.append(Mode.swap)
            s -= 1
        if c:
            seq.append(Mode.checkpoint)
            c -= 1
    modes = [Mode.keep] * n_blocks
    for b, mode in zip(repeated, seq, strict=False):
        modes[b] = mode
    return tuple(modes)


def knob_table(n_blocks: int, repeated: list[int], combos: list[tuple[int, int]]) -> np.ndarray:
    """`knob_modes` for every (n_swap, n_ckpt) at once: one row of Mode values per combination."""
    k = np.arange(len(repeated))
    ns = np.array([s for s, _ in combos], dtype=np.int64)[:, None]
    nc = np.array([c for _, c in combos], dtype=np.int64)[:, None]
    m = np.minimum(ns, nc)
    # position k of the optimised prefix: alternating S, C while both last, then the rest of the larger one
    alternating = np.where(k % 2 == 0, Mode.swap, Mode.checkpoint)
    tail = np.where(ns > nc, Mode.swap, Mode.checkpoint)
    rep = np.where(k < 2 * m, alternating, np.where(k < ns + nc, tail, Mode.keep)).astype(np.int8)
    out = np.full((len(combos), n_blocks), Mode.keep, dtype=np.int8)
    out[:, repeated] = rep
    return out


def _activation_tables(inst: PolicyInstance, combos: list[tuple[int, int]]) -> tuple[np.ndarray, ...]:
    """Per (n_swap, n_ckpt): the mode rows, activation peak bytes, swapped bytes (host), total recompute ns."""
    B = inst.n_blocks
    repeated = [b for b in range(B) if inst.optimisable[b]]
    M = knob_table(B, repeated, combos)
    act = np.array(inst.act_bytes, dtype=np.int64)
    inp = np.array(inst.inp_bytes, dtype=np.int64)
    ftp = np.array(inst.fwd_peak_bytes, dtype=np.int64)
    btp = np.array(inst.bwd_peak_bytes, dtype=np.int64)
    ck, sw = M == Mode.checkpoint, M == Mode.swap
    retained = np.where(M == Mode.keep, act, np.where(ck, inp, 0))
    prefix = np.cumsum(retained, axis=1) - retained
    fwd_own = np.where(ck, inp, act) + ftp
    bwd_own = act + btp + np.where(ck, inp, 0)
    bwd_own[:, 1:] += np.where(sw[:, :-1], act[:-1], 0)
    if inst.copy_overlap:  # a swapped block's storages live through the next block's forward (cost_model)
        fwd_own[:, 1:] += np.where(sw[:, :-1], act[:-1], 0)
    peak = np.maximum(prefix + fwd_own, prefix + bwd_own).max(axis=1)
    swapped = np.where(sw, act, 0).sum(axis=1)
    rec = np.where(ck, np.array(inst.rec_ns, dtype=np.int64), 0).sum(axis=1)
    return M, peak, swapped, rec


def search(inst: PolicyInstance, *, prune_memory: bool = True, prune_bound: bool = True) -> ProTrainResult:
    """Best decision over ProTrain's knobs under the instance's limits (None when nothing fits)."""
    B, C = inst.n_blocks, inst.n_chunks
    repeated = [b for b in range(B) if inst.optimisable[b]]
    n_rep = len(repeated)
    combos = [(s, c) for s in range(n_rep + 1) for c in range(n_rep + 1 - s)]
    modes, peak, swapped, rec = _activation_tables(inst, combos)
    order = np.argsort(rec, kind="stable")
    base = sum(inst.fwd_ns) + sum(inst.bwd_ns)
    keep_row = np.zeros((1, B), dtype=np.int8)
    timer = BatchTimer(inst)
    best: tuple[int, Decision, Cost] | None = None
    evaluated = 0
    pinned_cap = inst.host_limit_bytes if inst.pinned_limit_bytes is None else inst.pinned_limit_bytes
    per_node = inst.ranks_per_node  # host RAM is the node's (1 for a single-rank job)
    # a multi-rank job shards every offloaded chunk and replicates the persistent ones (see cost_model)
    sharded = inst.sharded_job
    host_of = inst.shard_host_bytes_of if sharded else tuple(inst.host_bytes(c) for c in range(C))
    pinned_of = inst.shard_pinned_bytes_of if sharded else tuple(inst.pinned_bytes(c) for c in range(C))
    state_prefix = [0]  # device bytes of chunks 0..c-1 if persistent
    host_prefix = [0]  # host bytes of chunks 0..c-1 if offloaded: states + the runtime's host extras
    pinned_prefix = [0]
    for c in range(C):
        state_prefix.append(state_prefix[-1] + inst.state_bytes(c))
        host_prefix.append(host_prefix[-1] + host_of[c])
        pinned_prefix.append(pinned_prefix[-1] + pinned_of[c])
    # device-sharded persistent prefix (ZeRO-3 on the device, where the instance has its terms): each prefix
    # length is tried with its persistent chunks replicated and sharded on the device (the same cost model)
    device_options = (False, True) if sharded and inst.device_shard_bytes_of else (False,)
    dshard_prefix = [0]
    for c in range(C):
        dshard_prefix.append(
            dshard_prefix[-1] + (inst.device_shard_bytes_of[c] if inst.device_shard_bytes_of else 0)
        )
    gathered = inst.device_gather_bytes_of
    for n_persist, on_device in ((n, dev) for n in range(C, -1, -1) for dev in device_options):
        n_off = C - n_persist
        if on_device and (n_persist == 0 or not all(inst.device_shardable(c) for c in range(n_persist))):
            continue
        # chunks 0..n_persist-1 stay (whole, or their shards and two gathered copies), the rest are offloaded
        persist_bytes = (
            dshard_prefix[n_persist] + 2 * max(gathered[:n_persist]) if on_device else state_prefix[n_persist]
        )
        offloaded = tuple([False] * n_persist + [True] * n_off)
        # the offloaded chunks, all sharded (and the persistent ones when sharded on the device)
        shards = tuple([on_device] * n_persist + [True] * n_off) if sharded else ()
        n_buf = n_off
        need = inst.min_buffers(offloaded)  # a module spanning offloaded chunks needs them in buffers at once
        dev_opt = sum((inst.shard_device_optim_ns if on_device else inst.device_optim_ns)[:n_persist])
        if prune_bound and best is not None and n_buf:
            # more buffers are never slower, so keeping every block with the most buffers that fit bounds
            # every (n_buffer, n_swap, n_checkpoint) of this n_persist from below
            nb_max = min(
                n_buf, max(need, (inst.usable_device_bytes - persist_bytes) // max(inst.buffer_bytes, 1))
            )
            evaluated += 1
            if int(timer(offloaded, nb_max, keep_row, shards)[0]) >= best[0]:
                continue
        for nb in range(need, n_buf + 1) if n_buf else (0,):
            static = persist_bytes + nb * inst.buffer_bytes
            pinned_chunks = pinned_prefix[C] - pinned_prefix[n_persist]
            host_chunks = host_prefix[C] - host_prefix[n_persist]
            if prune_memory and static > inst.usable_device_bytes:
                break  # more buffers only add memory
            if prune_memory:
                ok = (
                    (static + peak[order] <= inst.usable_device_bytes)
                    & ((host_chunks + swapped[order]) * per_node <= inst.host_limit_bytes)
                    & (pinned_chunks + swapped[order] <= pinned_cap)
                )
                candidates = order[ok]
            else:
                candidates = order
            if prune_bound and best is not None:
                candidates = candidates[base + rec[candidates] + dev_opt < best[0]]
                if candidates.size and int(timer(offloaded, nb, keep_row, shards)[0]) >= best[0]:
                    # keeping every block is the fastest mode setting for these placements: a lower bound
                    evaluated += 1
                    continue
            if candidates.size == 0:
                continue
            times = timer(offloaded, nb, modes[candidates], shards)
            evaluated += int(candidates.size)
            for j in np.argsort(times, kind="stable"):
                k = int(candidates[j])
                if best is not None and int(times[j]) >= best[0]:
                    break
                s, c = combos[k]
                d = Decision(
                    offloaded=offloaded, n_buffers=nb, modes=knob_modes(B, repeated, s, c), sharded=shards
                )
                cost = evaluate_decision(inst, d)
                if cost.fits:  # always true after memory pruning; checked for the unpruned ablation
                    best = (cost.iteration_ns, d, cost)
                    break
    if best is None:
        return ProTrainResult(None, None, evaluated)
    return ProTrainResult(best[1], best[2], evaluated)
