"""Cost model: predicted iteration time and peak memory of a memory policy, from a trace's measurements.

Reference: ProTrain (arXiv 2406.08334, App. A), extended where the trace allows. Times are integer ns,
memory integer bytes (see `instance.py`); `evaluate` converts to seconds at the end. The CP-SAT model in
`cpsat_model.py` encodes exactly these formulas, so its optimum equals `evaluate_decision` of its answer.

Execution is cut into *windows*, one per chunk: the blocks whose parameters live in the chunk (a block
without parameters joins the window of the chunk before it). With `o[c]` = chunk c offloaded:

Forward (chunks 0..C-1):
  Tf[c] = max(F[c], H2D, D2H)              full duplex (separate copy engines per direction)
        = max(F[c], H2D + D2H)              half duplex (ProTrain: swap shares the link with prefetch)
    F[c]  = sum of block forward times in the window
    H2D   = o[c+1] * upload(c+1)           prefetch of the next chunk while this one computes
    D2H   = sum of swap-out copies of the window's swapped blocks
    with one buffer, an offloaded chunk followed by an offloaded chunk cannot prefetch:
    Tf[c] >= F[c] + upload(c+1)
  T_fwd = o[0] * upload(0) + sum Tf[c]     (the first upload is exposed)
  Concurrent copies (full duplex, when the trace measured both directions at once: `duplex_*_pinned`): a
  window with H2D and D2H copies both non-zero charges each at its concurrent rate instead,
    Tf[c] = max(F[c], H2D_duplex, D2H_duplex)     (the same copies over the duplex curves)
  and at the one-direction rates otherwise; without those curves (older traces) nothing changes. The same
  rule holds in backward.

Backward (chunks C-1..0):
  resident[c] = o[c] and fewer than n_buffers offloaded chunks come after c: it is still in a buffer at
  the end of forward and is not uploaded again ("chunks still in a buffer after forward are not re-fetched").
  Tb[c] = max(Bk[c], H2D, D2H)   (or max(Bk, H2D + D2H) half duplex)
    Bk[c] = sum of block backward times + recompute of checkpointed blocks in the window
    H2D   = need[c-1] * upload(c-1) + swap-in of the swapped blocks of window c-1 (prefetch one window ahead)
    D2H   = o[c+1] * grad_offload(c+1)     (gradients of the chunk that just finished go to host)
    one buffer: Tb[c] >= Bk[c] + upload(c-1) when c and c-1 are both offloaded
  T_bwd = need[C-1] * upload(C-1) + swap-in of window C-1 + sum Tb[c]

Tied chunks (`late_uses.py`; `PolicyInstance.late_uses`, pairs (c, w) with w > c: a parameter of chunk c used
again by a block of window w, GPT-2's word embedding as lm_head). With need[c] (c offloaded and not resident):
  forward:  window w's H2D += upload(c) (re-uploaded there); one buffer: Tf[w] >= F[w] + sum of those uploads
  backward: the first resident chunk r is displaced (c holds its buffer when backward starts): need[r] = 1
  uploads per iteration (`Cost.uploads`) = offloaded chunks + those re-uploads + sum need[c] (r counted)

Optimizer:
  T_dev_opt = sum over persistent chunks of used bytes / device optimizer rate.
  Host optimizer: one worker thread steps offloaded chunks in the order their gradients arrive (C-1..0);
  chunk c's gradients arrive at done(c) + grad_offload(c), where done(c) is backward time through window c.
  For a FIFO single worker the finish time is exactly
    T_host_end = max over c of (done(c) + o[c] * grad_offload(c) + sum_{c' <= c} o[c'] * host_step(c'))
  (measured from the start of backward).
  T_iter = T_fwd + max(T_bwd + T_dev_opt, T_host_end)    (ProTrain: max(T_bwd + T_gpu_optim, T_cpu_optim))
  Validation: at optimizer.step() the training thread checks each offloaded chunk's exposed `.grad` against the
  gradient its speculative host step used (`val(c)`, `instance.validate_ns`), chunk by chunk in the order their
  host steps finish (C-1..0), each after its step: the checks of chunks stepped during backward follow it, the
  last one follows the worker's last step (chunk 0's, the FIFO's last):
    T_after = max(T_bwd + T_dev_opt + sum o[c] * val(c), T_host_end + val(first offloaded chunk))
  replaces max(T_bwd + T_dev_opt, T_host_end) above (val = 0 on a serial device: its measured offload overhead
  holds the check).

Without copy/compute overlap (`CostParams.copy_overlap` False; the default for a CPU "device", whose
"host" is the same memory and cores and whose streams are no-ops), every max() above becomes a sum:
  Tf[c] = F[c] + H2D + D2H,  Tb[c] = Bk[c] + H2D + D2H  (the one-buffer rule is then implied)
  T_host_end = T_bwd + T_dev_opt + o[0] * grad_offload(0) + sum over offloaded c of host_step(c)
  (the first chunk's gradient copy has no window after it; the host optimizer runs serially), so
  T_iter = T_fwd + T_bwd + T_dev_opt + o[0] * grad_offload(0) + T_host_optim.
  On such a device grad_offload(c) holds the chunk runtime's measured per-chunk cost (the trace's
  offload_overhead_s), and the part of it paid in forward (`offload_forward_s`: the residency hooks and what
  autograd adds around them in the chunk's blocks' forward) moves from grad_offload(c) to Tf[c], and the part
  paid in optimizer.step() (`offload_step_s`: its settling of the chunk's speculative step) to the end of the
  iteration, after T_host_end (in `settled_ns`, so the step's predicted phase holds it): T_iter is the same
  sum, T_fwd, T_bwd and the step are where the runtime pays them (before, the 2-rank benchmark's forward ran
  over its prediction in every saved run of sessions 30-32, by a median of +1.2 to +8.5 ms per run, and its
  step by +1.3 to +2.0 ms).

Speculative host steps and clipping (`Workload.clips_gradients`, with undo backups kept): the host steps run
during backward as above on the unclipped gradient; when clipping scales the gradients, optimizer.step()
restores every offloaded chunk and steps it again, after backward and before step() returns:
  T_iter += T_host_redo = sum over offloaded c of host_step(c)   (worst case: clipping scales every step,
  as it does early in training; later, when the norm stays under max_norm, nothing is redone)

Peak device memory (walk of the blocks, as ProTrain's "memory-aware" estimate):
  static = persistent chunks' model states (at their used bytes) + n_buffers device buffers (full size)
  retained(b) = activation bytes (keep), input bytes (checkpoint), 0 (swap, copied out)
  forward of b:  static + sum_{b'<b} retained(b') + (act(b) | input(b) if checkpoint) + fwd transient peak(b)
                 + act(b-1) if b-1 is swapped and copies overlap compute (its copy-out may still read it: the
                 runtime lets a swapped block's storages go at the end of the next block's forward)
  backward of b: static + sum_{b'<b} retained(b') + act(b) [+ input(b) if checkpoint: one block's
                 recomputed activations] + bwd transient peak(b) + act(b-1) if b-1 is swapped (prefetched)
                 (the transient includes tied gradients held meanwhile: `held_gradients.py`)
  peak = max over both walks; the plan fits when peak * (1 + alpha) <= device limit.
Host memory: offloaded chunks' model states + the runtime's host extras (fp32 host gradient when an fp32
master is stepped, the `.grad` exposed after backward, mixed-precision staging, the undo backup of
speculative steps: master + optimizer state) + swapped activations; must fit the host limit. The pinned
part (per offloaded chunk `client.contract.offloaded_chunk_pinned_bytes`: upload source, gradient staging,
the host gradient without a separate fp32 master; plus the swapped activations) must fit the pinned limit
when one is known. It is `Predictions.pinned_host_bytes`: the runtime's one pinned host arena is exactly
that size (issue 19, defect 8).

Multi-rank jobs (issue 20; world size N > 1, R ranks per node; constants in `sharding.py`). Every figure
is one rank's; all ranks run the same plan on equal shards, so one rank's time is the job's. ZeRO-Offload
style ("ZeRO-2 on the host") for offloaded chunks; a persistent chunk may be sharded on the device (ZeRO-3,
`agent/runtime/device_shards.py`: dsh[c] below). Per chunk c:
  sh[c]  sharded (offloaded only): exposed `.grad` whole on every rank's host; the compute copy (the upload
         source) node-shared when all ranks are on one node (`PolicyInstance.compute_copy_shared`: one copy
         per node, a rank's share is 1/N of it) or whole on every rank (several nodes); the rest of its host
         state (host gradient, master, optimizer state, staging, undo backup) 1/N per rank
         (s = ceil(elements / N) rounded up to 4 elements); else replicated (whole on every rank)
  up(c)  = o[c] * H2D of the WHOLE chunk, sharded or not (it is uploaded from the full host copy), so the
         forward windows, residency and the one-buffer rule are the single-process ones (no collectives)
  red(c) = reduce-scatter of its gradient when sharded, all-reduce when replicated (every persistent chunk)
  gout(c)= o[c] * D2H of the rank's gradient shard (sharded) or of the whole gradient (replicated)
  step(c)= o[c] * host step of the shard (sharded) or of the whole chunk; persistent chunks step whole on
         the device
  fill(c)= sh[c] * all-gather of the shards' host gradients into the exposed `.grad` (N * s elements, compute
         dtype), on the host worker right before the chunk's step (the runtime's `fill_user_grad`)
  ag(c)  = sh[c] * all-gather of the private compute copy (N * s elements) on the host at step() (several
         nodes); 0 when the copy is node-shared (each rank wrote its stepped shard into the one copy)
  bar    = one barrier at step() when the copy is node-shared and any chunk is sharded (`step_barrier_ns`:
         the sharded chunks' next uploads wait on it); else 0
  dsh[c] persistent and sharded on the device: device bytes `device_shard_bytes_of` (its shard of compute copy,
         master and optimizer state, the gradient whole) instead of the chunk's state bytes; red(c) = the
         all-reduce (as replicated); device step of the shard `shard_device_optim_ns`; its two all-gathers per
         iteration (forward, backward; prefetched on the backend's stream) exposed by (1 - f), all of them
         without copy overlap: T_iter += sum dsh[c] * device_gather_exposed_ns(c); static device bytes +=
         2 * max dsh[c] * device_gather_bytes_of[c] (the gathered copy in use and the next, prefetched)
Collectives on the device (the gradient reductions) run on their own stream beside the copy engines and
compute. With overlap factor f (the least measured `CollectiveCopyOverlap.factor`, in 1/1000; 0 when not
measured) a backward window with compute X, copies h2d/d2h, collectives `comm` and a dependency chain `chain`
takes
  copies = max(h2d, d2h)  (h2d + d2h half duplex)
  link   = max(chain, copies + (1 - f) * comm, comm + (1 - f) * copies)
         = max(chain, max(copies, comm) + (1 - f) * min(copies, comm))   (f = 1: concurrent; 0: serialised)
  T      = max(X, link)           (each (1 - f) term rounded up to whole ns, as the CP-SAT rows are)
  without copy overlap (CPU): T = X + h2d + d2h + comm
Backward window c: comm = red(c+1), h2d = need[c-1] * up(c-1) + swap-in of window c-1, d2h = gout(c+1),
  chain = red(c+1) + gout(c+1) (the chunk that just finished is reduced, then its gradient copied out);
  T_bwd = need[C-1] * up(C-1) + swap-in of the last window + sum Tb[c] + red(0)
  (chunk 0's reduction has no window after it). A persistent chunk's all-reduce too: the runtime averages it as
  backward completes it (`GradientFlow.average_early`, the host worker's offload stream on CUDA; policy-1.13;
  1.12 charged them after backward, where the runtime ran them until then; on a CPU device the runtime still
  runs them after backward, which the serial windows price the same). Where the ranks' forwards used
  different persistent parameters the runtime averages them after backward instead, unpriced. The concurrent
  (duplex) copy rates are not applied.
Host worker: an offloaded chunk's gradient arrives at done(c) + red(c) + gout(c); the FIFO worker then
  fills its `.grad` and steps it:
    T_host_end = max over c of (done(c) + o[c] * (red(c) + gout(c)) + sum_{c' <= c} (fill(c') + step(c')))
  At optimizer.step(), after every step settled, the host worker runs the step's collectives (unconditionally:
  no rank's own validation decides a collective); when clipping redoes the speculative steps they come first.
  Several nodes: the sharded chunks' private compute copies are all-gathered (ag(c), at the measured
  all-gather rate), in chunk order, as the runtime queues them. One node: no gathers; one barrier (bar):
    T_after = sum ag(c) + bar (+ sum step(c) when redone), added after max(T_bwd + T_dev_opt, T_host_end).
  So neither the gathers nor the barrier hide behind backward (gathering each chunk right after its
  speculative step, and again only where a rank-agreed validation failed, would hide them: not built).
  Serial (CPU): T_host_end = T_bwd + T_dev_opt + gout(0) + sum of the FIFO's work.
Memory of one rank: device as one process (persistent chunks whole + n_buffers buffers); host = offloaded
  chunks (sharded: N * s * elt [.grad] + N * s * elt [private compute copy] or s * elt [its share of the
  node-shared one] + s * the rest per element; replicated: whole) + swapped activations.
  Host RAM is the node's: R * host <= host limit (node-shared copies: R * s * elt = the one copy per node).
  The pinned limit is one rank's (process's): a sharded chunk pins its compute copy (whole, or its share of
  the node's), its shard's staging buffer and, without a separate fp32 master, its shard's host gradient
  (`client.contract.sharded_chunk_pinned_bytes`).
Control checks (every multi-rank iteration, `control_checks_ns`): the runtime's tiny synchronous collectives,
  added to the iteration (no window hides them: each blocks its issuing thread). Those at a phase's end cost
  `phase_control_ns` (pctl: measured after a phase's worth of compute, the ranks' skew over it included), the
  device-shard agreements before each all-gather `control_ns` (ctl):
    T_iter += pctl * ([any chunk offloaded] + 1 + 2 * [any dsh])
              + ctl * (2 * sum dsh[c] + [any chunk offloaded and any dsh])
  (the same-use check at backward's start, the agreement on the entries with a gradient at its end (every
  plan: persistent and offloaded chunks, `GradientFlow.agree`; policy-1.14), the device-shard agreements at the
  ends of forward and backward; the agreements before a device-sharded chunk's two all-gathers, and the one at
  backward's start that keeps a forward made on some ranks only from pairing the same-use check with another
  size: `DeviceShards.agree`).
At N = 1 every term reduces to the single-process formulas above (a test holds plans and costs fixed).

Why one module over 400 lines: the time and memory terms of a policy are one formula, term by term the one
`cpsat_model.py` encodes; split, the terms that must change together would sit apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from client.contract import ActivationMode, Constraints, Placement, Policy, Predictions, TimelinePoint, Trace
from client.contract.common import MAX_NAME_CHARS
from planner_service.solver.chunk_grid import layout_from_chunks
from planner_service.solver.instance import CostParams, Decision, Mode, PolicyInstance, build_instance
from planner_service.solver.late_uses import displaced_chunk, late_uploads
from planner_service.solver.sharding import PERMILLE

_MODE_OF = {
    ActivationMode.keep: Mode.keep,
    ActivationMode.checkpoint: Mode.checkpoint,
    ActivationMode.swap: Mode.swap,
}


@dataclass(frozen=True)
class Cost:
    """Integer result of the cost model for one decision (ns and bytes)."""

    iteration_ns: int
    forward_ns: int
    backward_ns: int
    device_optim_ns: int
    host_optim_ns: int  # total host optimizer work
    host_end_ns: int  # host optimizer finish, from the start of backward
    host_redo_ns: (
        int  # at optimizer.step(), after backward: steps redone (clipping), then all-gathers or the barrier
    )
    host_validate_ns: int  # optimizer.step()'s checks of the exposed `.grad` (module docstring, "Validation")
    settled_ns: int  # when step()'s settling ends, from the start of backward (before redo and collectives)
    forward_compute_ns: int
    backward_compute_ns: int
    recompute_ns: int
    peak_device_bytes: int
    static_device_bytes: int
    activation_peak_bytes: int
    host_bytes: int
    pinned_bytes: (
        int  # the pinned part of host_bytes (offloaded chunks' pinned buffers + swapped activations)
    )
    fits_device: bool
    fits_host: bool
    # multi-rank jobs (zero at world size 1): collective work on the device during backward (gradient
    # reductions), on the host after the host steps (all-gathers of sharded chunks' private compute copies, or
    # the one barrier of node-shared ones), and the node's host bytes (host_bytes is one rank's;
    # ranks_per_node ranks share the node)
    backward_collective_ns: int = 0
    host_collective_ns: int = 0
    host_node_bytes: int = 0
    # device-sharded persistent chunks: their all-gathers' time compute does not hide (in iteration_ns)
    device_gather_ns: int = 0
    # the runtime's control checks (tiny synchronous collectives, `control_checks_ns`; in iteration_ns)
    control_ns: int = 0
    # chunk uploads per iteration (forward, a tied chunk's re-upload, backward's), as the runtime counts them
    uploads: int = 0

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


def _combine(
    compute: int,
    h2d: int,
    d2h: int,
    full_duplex: bool,
    copy_overlap: bool = True,
    both_ways: tuple[int, int] | None = None,
) -> int:
    """One window's time: copies hidden behind compute (GPU), or added to it (CPU: no overlap). `both_ways`:
    the window's H2D and D2H copy times at the concurrent rates, charged when both directions copy."""
    if not copy_overlap:
        return compute + h2d + d2h
    if full_duplex and both_ways is not None and h2d > 0 and d2h > 0:
        return max(compute, *both_ways)
    return max(compute, h2d, d2h) if full_duplex else max(compute, h2d + d2h)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _combine_sharded(compute: int, h2d: int, d2h: int, comm: int, chain: int, inst: PolicyInstance) -> int:
    """One window's time in a multi-rank job (see "Multi-rank jobs" in the module docstring)."""
    if not inst.copy_overlap:
        return compute + h2d + d2h + comm
    copies = max(h2d, d2h) if inst.params.full_duplex else h2d + d2h
    slow = PERMILLE - inst.collective_overlap_permille
    link = max(
        chain,
        _ceil_div(PERMILLE * copies + slow * comm, PERMILLE),
        _ceil_div(PERMILLE * comm + slow * copies, PERMILLE),
    )
    return max(compute, link)


@dataclass(frozen=True)
class ChunkTerms:
    """Per chunk, the times and bytes a decision gives it (ns, bytes); at world size 1 the single-process
    terms (no collectives, whole chunks)."""

    upload: tuple[int, ...]  # H2D of the whole chunk when offloaded (sharded or not), else 0
    reduce: tuple[int, ...]  # gradient reduce-scatter (sharded) or all-reduce (replicated, N > 1), else 0
    grad_offload: tuple[
        int, ...
    ]  # D2H of the gradient (the rank's shard when sharded) when offloaded, else 0
    device_optim: tuple[int, ...]
    host_optim: tuple[int, ...]  # the host step (of the rank's shard when sharded) when offloaded, else 0
    host_gather: tuple[int, ...]  # all-gather of a sharded chunk's private compute copy at step(), else 0
    grad_fill: tuple[int, ...]  # all-gather of a sharded chunk's `.grad` before its host step, else 0
    device_bytes: tuple[int, ...]  # model-state bytes on one rank's device
    host_bytes: tuple[int, ...]  # host bytes of one rank
    pinned_bytes: tuple[int, ...]
    step_barrier: int = 0  # the barrier at step() (node-shared compute copies, any chunk sharded), else 0
    control: int = 0  # the runtime's control checks per iteration (`control_checks_ns`; 0 at N = 1)
    # device-sharded persistent chunks (ZeRO-3 on the device): per chunk its exposed all-gather time per iteration
    # (forward and backward), and the bytes of its whole copy while gathered (0 for every other chunk)
    device_gather: tuple[int, ...] = ()
    gathered_bytes: tuple[int, ...] = ()
    # optimizer.step()'s check of the exposed `.grad` (the rank's shard when sharded) when offloaded, else 0
    validate: tuple[int, ...] = ()


def device_gather_exposed_ns(inst: PolicyInstance, c: int) -> int:
    """A device-sharded chunk's two all-gathers per iteration (before its forward and before its backward use),
    prefetched one chunk ahead on the backend's stream: the part of them compute does not hide. Without copy
    overlap (CPU) all of it; else the (1 - f) share of the measured collective/copy overlap factor f (0, i.e.
    all of it, when none was measured: cautious)."""
    both = 2 * inst.device_gather_ns[c]
    if not inst.copy_overlap:
        return both
    return _ceil_div((PERMILLE - inst.collective_overlap_permille) * both, PERMILLE)


def control_checks_ns(
    inst: PolicyInstance, offloaded: tuple[bool, ...], device_sharded: tuple[bool, ...]
) -> int:
    """The runtime's control checks of one multi-rank iteration, each one tiny synchronous collective. At a
    phase's end (`inst.phase_control_ns`): the same-use check at backward's start when
    any chunk is offloaded (`GradientFlow.check_same_use`), the agreement on the entries with a gradient at
    backward's end in every plan (`GradientFlow.agree`: persistent chunks, and since policy-1.14 the offloaded
    chunks backward averaged; a plan whose chunks hold no trained parameter skips it: counted, cautious), and with device-sharded chunks one agreement at the end of forward and one at the end
    of backward (`DeviceShards.agree`); and an agreement before each of a device-sharded chunk's two all-gathers
    per iteration and, with offloaded chunks too, one at backward's start before the same-use check
    (`inst.control_ns`). 0 at world size 1."""
    if not inst.control_ns:
        return 0
    n_dsh = sum(device_sharded)
    at_phase_end = int(any(offloaded)) + 1 + (2 if n_dsh else 0)
    # with both kinds, the device-shard agreement at backward's start, before the same-use check (right after
    # forward's end agreement: the plain figure)
    at_backward_start = int(any(offloaded) and n_dsh > 0)
    return at_phase_end * inst.phase_control_ns + (2 * n_dsh + at_backward_start) * inst.control_ns


def after_backward_ns(bwd_dev_opt: Any, host_end: Any, validate: tuple[int, ...]) -> Any:
    """When optimizer.step()'s settling ends (from the start of backward; ints or per-row arrays): the training
    thread's checks of the offloaded chunks' exposed `.grad` (`validate`, per chunk, 0 where not offloaded) after
    backward and the device steps, the last one after the host worker's last step (the first offloaded chunk's:
    the FIFO steps C-1..0) (module docstring, "Validation")."""
    last = next((v for v in validate if v), 0)
    return np.maximum(bwd_dev_opt + sum(validate), host_end + last)


def gathered_peak_bytes(k: ChunkTerms) -> int:
    """Device bytes of whole copies of device-sharded chunks held at once: the one in use and the next one,
    prefetched (twice the largest; a chunk holding a tied parameter used at both ends stays gathered through
    backward: not counted)."""
    return 2 * max(k.gathered_bytes, default=0)


def chunk_terms(inst: PolicyInstance, d: Decision) -> ChunkTerms:
    """The decision's per-chunk terms (see the module docstring, "Multi-rank jobs")."""
    C, o = inst.n_chunks, d.offloaded
    upload = tuple(inst.upload_ns[c] if o[c] else 0 for c in range(C))
    device_optim = tuple(0 if o[c] else inst.device_optim_ns[c] for c in range(C))
    device_bytes = tuple(0 if o[c] else inst.state_bytes(c) for c in range(C))
    if not inst.sharded_job:
        zero = (0,) * C
        return ChunkTerms(
            upload=upload,
            reduce=zero,
            grad_offload=tuple(inst.grad_offload_ns[c] if o[c] else 0 for c in range(C)),
            device_optim=device_optim,
            host_optim=tuple(inst.host_optim_ns[c] if o[c] else 0 for c in range(C)),
            host_gather=zero,
            grad_fill=zero,
            device_bytes=device_bytes,
            host_bytes=tuple(inst.host_bytes(c) if o[c] else 0 for c in range(C)),
            pinned_bytes=tuple(inst.pinned_bytes(c) if o[c] else 0 for c in range(C)),
            validate=tuple(inst.validate(c) if o[c] else 0 for c in range(C)),
        )
    dsh = d.sharded_chunks(inst)
    sh = tuple(dsh[c] and o[c] for c in range(C))  # offloaded and sharded (ZeRO-2 on the host)
    z = tuple(dsh[c] and not o[c] for c in range(C)) if inst.device_shard_bytes_of else (False,) * C
    # a persistent chunk is replicated (whole on every rank, its gradient all-reduced, stepped on the device) or
    # sharded on the device (its shard of the steady state, gathered before use, the gradient whole and
    # all-reduced, the shard stepped); an offloaded chunk is uploaded whole, and sharded (the rank's shard of its
    # gradient copied out, stepped, then at step() its private compute copy all-gathered, or one barrier for all
    # node-shared ones) or replicated (whole everywhere)
    if any(z):
        device_optim = tuple(inst.shard_device_optim_ns[c] if z[c] else device_optim[c] for c in range(C))
        device_bytes = tuple(inst.device_shard_bytes_of[c] if z[c] else device_bytes[c] for c in range(C))
    return ChunkTerms(
        device_gather=tuple(device_gather_exposed_ns(inst, c) if z[c] else 0 for c in range(C)),
        gathered_bytes=tuple(inst.device_gather_bytes_of[c] if z[c] else 0 for c in range(C)),
        upload=upload,
        reduce=tuple(inst.reduce_scatter_ns[c] if sh[c] else inst.all_reduce_ns[c] for c in range(C)),
        grad_offload=tuple(
            (inst.shard_grad_offload_ns[c] if sh[c] else inst.grad_offload_ns[c]) if o[c] else 0
            for c in range(C)
        ),
        device_optim=device_optim,
        host_optim=tuple(
            (inst.shard_host_optim_ns[c] if sh[c] else inst.host_optim_ns[c]) if o[c] else 0 for c in range(C)
        ),
        host_gather=tuple(inst.gather_ns[c] if sh[c] else 0 for c in range(C)),
        validate=tuple(inst.validate(c, sharded=sh[c]) if o[c] else 0 for c in range(C)),
        grad_fill=tuple(inst.grad_fill_ns[c] if sh[c] else 0 for c in range(C)),
        device_bytes=device_bytes,
        host_bytes=tuple(
            (inst.shard_host_bytes_of[c] if sh[c] else inst.host_bytes(c)) if o[c] else 0 for c in range(C)
        ),
        pinned_bytes=tuple(
            (inst.shard_pinned_bytes_of[c] if sh[c] else inst.pinned_bytes(c)) if o[c] else 0
            for c in range(C)
        ),
        step_barrier=inst.step_barrier_ns if any(sh) else 0,
        control=control_checks_ns(inst, o, z),
    )


def host_queue(inst: PolicyInstance, k: ChunkTerms) -> tuple[tuple[int, ...], int]:
    """Per chunk, the host worker's FIFO work after the chunk's gradient arrives (a sharded chunk's `.grad`
    all-gather, then its step), and the work at optimizer.step() after every step settled: the sharded chunks'
    private compute-copy all-gathers (the runtime queues them there, in chunk order, so no rank's own validation
    decides a collective) or the one barrier of node-shared copies, after the steps redone when clipping changed
    the gradients (a redo steps the `.grad` the user left: nothing is gathered again)."""
    work = tuple(h + f for h, f in zip(k.host_optim, k.grad_fill, strict=True))
    collectives = sum(k.host_gather) + k.step_barrier
    if inst.redo_host_steps:
        return work, sum(k.host_optim) + collectives
    return work, collectives


def residency(offloaded: tuple[bool, ...], n_buffers: int) -> list[bool]:
    """Offloaded chunks still in a buffer at the end of forward: the last `n_buffers` offloaded ones."""
    out = [False] * len(offloaded)
    after = 0
    for c in range(len(offloaded) - 1, -1, -1):
        if offloaded[c]:
            out[c] = after < n_buffers
            after += 1
    return out


def activation_steps(inst: PolicyInstance, modes: tuple[Mode, ...]) -> tuple[list[int], list[int]]:
    """Device bytes above the static ones during each block's forward and each block's backward (by block)."""
    prefix = 0
    fwd: list[int] = []
    bwd: list[int] = []
    act, inp = inst.act_bytes, inst.inp_bytes
    for b, mode in enumerate(modes):
        if mode == Mode.checkpoint:
            fwd_own = inp[b] + inst.fwd_peak_bytes[b]
            bwd_own = inp[b] + act[b] + inst.bwd_peak_bytes[b]
            retained = inp[b]
        else:
            fwd_own = act[b] + inst.fwd_peak_bytes[b]
            bwd_own = act[b] + inst.bwd_peak_bytes[b]
            retained = act[b] if mode == Mode.keep else 0
        if b > 0 and modes[b - 1] == Mode.swap:
            bwd_own += act[b - 1]  # prefetched back for the previous block's backward
            if inst.copy_overlap:  # still read by its copy-out (the runtime lets it go after this block)
                fwd_own += act[b - 1]
        fwd.append(prefix + fwd_own)
        bwd.append(prefix + bwd_own)
        prefix += retained
    return fwd, bwd


def activation_peak(inst: PolicyInstance, modes: tuple[Mode, ...]) -> int:
    """Peak of activation-related bytes over the forward and backward walks (model states excluded)."""
    fwd, bwd = activation_steps(inst, modes)
    return max(fwd + bwd, default=0)


def device_timeline(inst: PolicyInstance, d: Decision, static_bytes: int) -> list[TimelinePoint]:
    """Predicted device bytes at every step: forward blocks in order, backward in reverse, then the optimizer."""
    fwd, bwd = activation_steps(inst, d.modes)

    def label(phase: str, b: int) -> str:
        # a block's name may already be the contract's longest (an epilogue of many modules, e.g. T5's
        # decoder): the label keeps the phase and cuts the name to fit, ending in "..."
        text = f"{phase} {inst.block_names[b] if inst.block_names else b}"
        return text if len(text) <= MAX_NAME_CHARS else text[: MAX_NAME_CHARS - 3] + "..."

    points = [
        TimelinePoint(label=label("fwd", b), phase="forward", device_bytes=static_bytes + x)
        for b, x in enumerate(fwd)
    ]
    points += [
        TimelinePoint(label=label("bwd", b), phase="backward", device_bytes=static_bytes + bwd[b])
        for b in range(len(bwd) - 1, -1, -1)
    ]
    points.append(TimelinePoint(label="optimizer", phase="optimizer", device_bytes=static_bytes))
    return points


def evaluate_decision(inst: PolicyInstance, d: Decision) -> Cost:
    """The cost model on integers. See the module docstring for every formula."""
    d.check(inst)
    C = inst.n_chunks
    nb = d.n_buffers
    duplex = inst.params.full_duplex
    overlap = inst.copy_overlap
    sharded = inst.sharded_job
    k = chunk_terms(inst, d)
    U, G, RS = k.upload, k.grad_offload, k.reduce
    # an offloaded chunk's measured per-chunk cost (in G) paid in its forward window (serial devices only:
    # moved, not added, so every sum, and the iteration, is the same; see "Serial devices" above)
    OF = [
        min(inst.offload_forward_ns[c], G[c]) if inst.offload_forward_ns and d.offloaded[c] else 0
        for c in range(C)
    ]
    # ... and the part paid in optimizer.step() (its settling of the chunk), after every other term
    OS = [
        min(inst.offload_step_ns[c], G[c] - OF[c]) if inst.offload_step_ns and d.offloaded[c] else 0
        for c in range(C)
    ]
    if any(OF) or any(OS):
        assert not inst.copy_overlap, "measured on serial devices only (instance.build_instance)"
        G = tuple(g - f - s for g, f, s in zip(G, OF, OS, strict=True))
    windows = max(C, 1)
    F = [0] * windows
    Bk = [0] * windows
    SO = [0] * windows
    SI = [0] * windows
    # the same copies at the concurrent rates (`inst.duplex`): charged in windows that copy both ways
    dx = inst.duplex
    Ux, Gx = (inst.upload_duplex_ns, inst.grad_offload_duplex_ns) if dx else (U, G)
    SOx = [0] * windows
    SIx = [0] * windows
    rec_total = 0
    for b, w in enumerate(inst.layout.chunk_of_block):
        F[w] += inst.fwd_ns[b]
        Bk[w] += inst.bwd_ns[b]
        if d.modes[b] == Mode.checkpoint:
            Bk[w] += inst.rec_ns[b]
            rec_total += inst.rec_ns[b]
        elif d.modes[b] == Mode.swap:
            SO[w] += inst.swap_out_ns[b]
            SI[w] += inst.swap_in_ns[b]
            if dx:
                SOx[w] += inst.swap_out_duplex_ns[b]
                SIx[w] += inst.swap_in_duplex_ns[b]
    off = lambda c: 0 <= c < C and d.offloaded[c]  # noqa: E731
    at = lambda xs, c: xs[c] if 0 <= c < C else 0  # noqa: E731
    res = residency(d.offloaded, nb)
    need = [d.offloaded[c] and not res[c] for c in range(C)]
    # a tied chunk not resident after forward is uploaded again in its later window, then resident when backward
    # starts in the place of the first resident chunk, which is uploaded again for backward (`late_uses.py`)
    reuploads = sum(1 for c, _ in inst.late_uses if need[c])
    late = late_uploads(inst.late_uses, U, need, windows)
    late_x = late_uploads(inst.late_uses, Ux, need, windows) if dx else late
    displaced = displaced_chunk(inst.late_uses, need, res)
    if displaced is not None:
        need[displaced] = True

    # forward: no collectives in any job (a sharded chunk is uploaded whole from its full host copy)
    fwd = U[0] if off(0) else 0
    for c in range(windows):
        h2d = at(U, c + 1) + late[c]
        both = ((Ux[c + 1] if off(c + 1) else 0) + late_x[c], SOx[c]) if dx else None
        t = _combine(F[c] + at(OF, c), h2d, SO[c], duplex, overlap, both)
        if nb == 1 and off(c) and off(c + 1):
            t = max(t, F[c] + U[c + 1])
        if nb == 1 and late[c]:  # demanded in the window: the one buffer holds the window's own chunk
            t = max(t, F[c] + late[c])
        fwd += t

    head = (U[C - 1] if C and need[C - 1] else 0) + SI[windows - 1]
    bwd_comm = 0
    Tb = [0] * windows
    for c in range(windows):
        refetch = c >= 1 and need[c - 1]
        up = at(U, c - 1) if refetch else 0
        h2d = up + (SI[c - 1] if c >= 1 else 0)
        d2h = at(G, c + 1)
        if sharded:
            reduce = at(RS, c + 1)
            bwd_comm += reduce
            # the gradient of the chunk that just finished is reduced, then (offloaded) copied out
            t = _combine_sharded(Bk[c], h2d, d2h, reduce, reduce + d2h, inst)
        else:
            both = (
                (
                    ((Ux[c - 1] if refetch else 0) + SIx[c - 1]) if c >= 1 else 0,
                    Gx[c + 1] if off(c + 1) else 0,
                )
                if dx
                else None
            )
            t = _combine(Bk[c], h2d, d2h, duplex, overlap, both)
        if nb == 1 and off(c) and off(c - 1):
            t = max(t, Bk[c] + U[c - 1])
        Tb[c] = t
    tail = RS[0] if C else 0  # chunk 0's gradient reduction: no window after it hides it
    bwd_comm += tail
    bwd = head + sum(Tb) + tail

    dev_opt = sum(k.device_optim)
    host_total = sum(k.host_optim)
    work, redo = host_queue(inst, k)  # the FIFO worker's work per chunk; what step() redoes (clipping)
    host_end = 0
    queued = sum(work)  # sum over c' <= c of the worker's work, walking c downwards
    dones = [0] * windows  # backward time through window c (windows run C-1..0)
    acc = head
    for c in range(windows - 1, -1, -1):
        acc += Tb[c]
        dones[c] = acc
    for c in range(C - 1, -1, -1):
        arrive = dones[c] + (RS[c] + G[c] if d.offloaded[c] else 0)
        host_end = max(host_end, arrive + queued)
        queued -= work[c]
    if not overlap:
        # serial: the first chunk's gradient copy (no window hides it) and the host optimizer follow
        # backward and the device optimizer, on the same cores
        host_end = bwd + dev_opt + (G[0] if C else 0) + sum(work)
    settled = int(after_backward_ns(bwd + dev_opt, host_end, k.validate)) + sum(OS)
    iteration = fwd + settled + redo + sum(k.device_gather) + k.control

    static = sum(k.device_bytes) + nb * inst.buffer_bytes + gathered_peak_bytes(k)
    act_peak = activation_peak(inst, d.modes)
    peak = static + act_peak
    swapped = sum(inst.act_bytes[b] for b, m in enumerate(d.modes) if m == Mode.swap)
    pinned = sum(k.pinned_bytes) + swapped
    host = sum(k.host_bytes) + swapped
    node_host = host * inst.ranks_per_node
    fits_host = node_host <= inst.host_limit_bytes and (
        inst.pinned_limit_bytes is None or pinned <= inst.pinned_limit_bytes
    )
    return Cost(
        iteration_ns=iteration,
        forward_ns=fwd,
        backward_ns=bwd,
        device_optim_ns=dev_opt,
        host_optim_ns=host_total,
        host_end_ns=host_end,
        host_redo_ns=redo,
        host_validate_ns=sum(k.validate),
        settled_ns=settled,
        forward_compute_ns=sum(F),
        backward_compute_ns=sum(Bk) - rec_total,
        recompute_ns=rec_total,
        peak_device_bytes=peak,
        static_device_bytes=static,
        activation_peak_bytes=act_peak,
        host_bytes=host,
        pinned_bytes=pinned,
        fits_device=peak <= inst.usable_device_bytes,
        fits_host=fits_host,
        backward_collective_ns=bwd_comm,
        host_collective_ns=sum(k.host_gather) + k.step_barrier,
        host_node_bytes=node_host,
        device_gather_ns=sum(k.device_gather),
        control_ns=k.control,
        uploads=sum(d.offloaded) + reuploads + sum(need),
    )


def predictions_of(inst: PolicyInstance, decision: Decision, cost: Cost) -> Predictions:
    """Seconds and named terms for the wire contract."""
    s = lambda ns: ns / 1e9  # noqa: E731
    return Predictions(
        iteration_s=s(cost.iteration_ns),
        forward_s=s(cost.forward_ns),
        backward_s=s(cost.backward_ns),
        device_optimizer_s=s(cost.device_optim_ns),
        host_optimizer_s=s(cost.host_optim_ns),
        peak_device_bytes=cost.peak_device_bytes,
        peak_host_bytes=cost.host_bytes,
        pinned_host_bytes=cost.pinned_bytes,
        breakdown={
            "forward_compute_s": s(cost.forward_compute_ns),
            "forward_exposed_copy_s": s(cost.forward_ns - cost.forward_compute_ns),
            "backward_compute_s": s(cost.backward_compute_ns),
            "recompute_s": s(cost.recompute_ns),
            "backward_exposed_copy_s": s(cost.backward_ns - cost.backward_compute_ns - cost.recompute_ns),
            "host_optimizer_end_s": s(cost.host_end_ns),
            "host_optimizer_exposed_s": s(max(0, cost.host_end_ns - cost.backward_ns - cost.device_optim_ns)),
            "host_optimizer_redo_s": s(cost.host_redo_ns),
            "host_validate_s": s(cost.host_validate_ns),
            # what the checks add after backward, the device steps and the host steps (step()'s own time beside
            # the device steps and the redo)
            "host_validate_exposed_s": s(
                cost.settled_ns - max(cost.backward_ns + cost.device_optim_ns, cost.host_end_ns)
            ),
            "static_device_bytes": float(cost.static_device_bytes),
            "activation_peak_bytes": float(cost.activation_peak_bytes),
            "peak_device_with_margin_bytes": float(cost.peak_device_bytes * (1.0 + inst.params.alpha)),
            "usable_device_bytes": float(inst.usable_device_bytes),
            "alpha": inst.params.alpha,
            "full_duplex": 1.0 if inst.params.full_duplex else 0.0,
            "copy_overlap": 1.0 if inst.copy_overlap else 0.0,
            "chunk_state_bytes": float(inst.chunk_state_bytes),
            "buffer_bytes": float(inst.buffer_bytes),
            "uploads_per_iteration": float(cost.uploads),
        }
        | (_sharded_breakdown(inst, decision, cost) if inst.sharded_job else {}),
        device_memory_timeline=device_timeline(inst, decision, cost.static_device_bytes),
    )


def _sharded_breakdown(inst: PolicyInstance, decision: Decision, cost: Cost) -> dict[str, float]:
    """The multi-rank terms (only in a multi-rank job's predictions: single-rank ones are unchanged)."""
    return {
        "world_size": float(inst.world_size),
        "ranks_per_node": float(inst.ranks_per_node),
        "sharded_chunks": float(sum(decision.sharded_chunks(inst))),
        "backward_collective_s": cost.backward_collective_ns / 1e9,
        "host_collective_s": cost.host_collective_ns / 1e9,
        "grad_fill_collective_s": sum(chunk_terms(inst, decision).grad_fill) / 1e9,
        "collective_copy_overlap": inst.collective_overlap_permille / PERMILLE,
        "compute_copy_shared": 1.0 if inst.compute_copy_shared else 0.0,
        "host_node_bytes": float(cost.host_node_bytes),
        # persistent chunks sharded on the device (ZeRO-3) and their all-gathers' exposed time
        "device_sharded_chunks": float(
            sum(s and not o for s, o in zip(decision.sharded_chunks(inst), decision.offloaded, strict=True))
        ),
        "device_gather_exposed_s": cost.device_gather_ns / 1e9,
        # the runtime's control checks (tiny synchronous collectives) per iteration
        "control_collective_s": cost.control_ns / 1e9,
    }


def decision_of(inst: PolicyInstance, policy: Policy) -> Decision:
    """The decision a wire policy encodes; raises ValueError (naming the field) when the policy was planned
    for another world size than the instance's trace."""
    if policy.world_size != inst.world_size:
        raise ValueError(
            f"policy.world_size: {policy.world_size}, the trace was measured at world size {inst.world_size}"
        )
    offloaded = tuple(c.placement == Placement.offloaded for c in policy.chunks)
    sharded = tuple(c.sharded for c in policy.chunks)
    return Decision(
        offloaded=offloaded,
        n_buffers=policy.n_buffers,
        modes=tuple(_MODE_OF[b.mode] for b in policy.blocks),
        sharded=sharded if inst.sharded_job else (),
    )


def instance_for_policy(
    trace: Trace, policy: Policy, constraints: Constraints, params: CostParams | None = None
) -> PolicyInstance:
    if len(policy.blocks) != len(trace.model.blocks):
        raise ValueError(
            f"policy.blocks: {len(policy.blocks)} entries, the trace has {len(trace.model.blocks)} blocks"
        )
    layout = layout_from_chunks(trace, policy.chunk_size_bytes, [c.parameters for c in policy.chunks])
    return build_instance(trace, layout, constraints, params)


def evaluate(
    trace: Trace, policy: Policy, constraints: Constraints, params: CostParams | None = None
) -> Predictions:
    """Predicted iteration time and peaks of `policy` on `trace` (the runtime compares these with measurements).

    Raises ValueError (naming the field) when the policy's layout does not match the trace.
    """
    inst = instance_for_policy(trace, policy, constraints, params)
    decision = decision_of(inst, policy)
    return predictions_of(inst, decision, evaluate_decision(inst, decision))


class BatchTimer:
    """`evaluate_decision(...).iteration_ns` for many mode vectors at once, on one instance.

    The same formulas as `evaluate_decision`, vectorised over rows of `modes` (int Mode values) with
    exact int64 arithmetic; the arrays that depend only on the instance are built once. The ProTrain
    search times every (n_swap, n_checkpoint) setting of one placement in one call.
    """

    def __init__(self, inst: PolicyInstance) -> None:
        self.inst = inst
        C = inst.n_chunks
        self.C, self.W = C, max(C, 1)
        i64 = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
        self.ind = np.zeros((inst.n_blocks, self.W), dtype=np.int64)
        self.ind[np.arange(inst.n_blocks), i64(inst.layout.chunk_of_block)] = 1
        self.F = i64(inst.fwd_ns) @ self.ind
        self.Bk = i64(inst.bwd_ns) @ self.ind
        self.rec, self.so, self.si = i64(inst.rec_ns), i64(inst.swap_out_ns), i64(inst.swap_in_ns)
        pad = lambda xs: np.concatenate([i64(xs), np.zeros(1, dtype=np.int64)])  # noqa: E731
        self.U, self.G = pad(inst.upload_ns), pad(inst.grad_offload_ns)  # index C reads 0
        self.H, self.D = i64(inst.host_optim_ns), i64(inst.device_optim_ns)
        self.V = tuple(inst.validate(c) for c in range(C))
        self.dx = inst.duplex  # concurrent copy times where a window copies both ways
        if self.dx:
            self.sox, self.six = i64(inst.swap_out_duplex_ns), i64(inst.swap_in_duplex_ns)
            self.Ux, self.Gx = pad(inst.upload_duplex_ns), pad(inst.grad_offload_duplex_ns)

    def _late_uploads(self, need: np.ndarray, o: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per window, the tied chunks' re-uploads (at the single and at the concurrent rates); marks the chunk
        they displace for backward in `need` (in place), as `evaluate_decision` does (`late_uses.py`)."""
        zero = np.zeros(self.W, dtype=np.int64)
        if not self.inst.late_uses:
            return zero, zero
        C, uses = self.C, self.inst.late_uses
        wanted = [bool(x) for x in need[:C]]
        resident = [bool(o[c]) and not wanted[c] for c in range(C)]
        late = np.array(late_uploads(uses, self.inst.upload_ns, wanted, self.W), dtype=np.int64)
        late_x = (
            np.array(late_uploads(uses, self.inst.upload_duplex_ns, wanted, self.W), dtype=np.int64)
            if self.dx
            else late
        )
        displaced = displaced_chunk(uses, wanted, resident)
        if displaced is not None:
            need[displaced] = 1
        return late, late_x

    def __call__(
        self, offloaded: tuple[bool, ...], n_buffers: int, modes: np.ndarray, sharded: tuple[bool, ...] = ()
    ) -> np.ndarray:
        if self.inst.sharded_job:
            return self._sharded(offloaded, n_buffers, modes, sharded)
        C, W, nb = self.C, self.W, n_buffers
        o = np.zeros(W + 1, dtype=np.int64)
        o[:C] = np.array(offloaded, dtype=np.int64)
        after = np.cumsum(o[::-1])[::-1] - o  # offloaded chunks after c
        need = o * (after >= nb)  # offloaded and not still in a buffer after forward
        late, late_x = self._late_uploads(need, o)
        U, G = (
            self.U[: W + 1] if C else np.zeros(W + 1, dtype=np.int64),
            self.G[: W + 1] if C else np.zeros(W + 1, dtype=np.int64),
        )
        ck = (modes == Mode.checkpoint).astype(np.int64)
        sw = (modes == Mode.swap).astype(np.int64)
        REC = (ck * self.rec) @ self.ind
        SO = (sw * self.so) @ self.ind
        SI = (sw * self.si) @ self.ind
        duplex = self.inst.params.full_duplex
        overlap = self.inst.copy_overlap

        def combine(
            compute: np.ndarray,
            h2d: np.ndarray,
            d2h: np.ndarray,
            both_ways: tuple[np.ndarray, np.ndarray] | None = None,
        ) -> np.ndarray:
            window: np.ndarray  # numpy's ufuncs are typed as returning Any
            if not overlap:
                window = compute + h2d + d2h
            elif duplex:
                window = np.maximum(np.maximum(compute, h2d), d2h)
                if both_ways is not None:  # both directions copy: the concurrent rates
                    both = np.maximum(np.maximum(compute, both_ways[0]), both_ways[1])
                    window = np.where((h2d > 0) & (d2h > 0), both, window)
            else:
                window = np.maximum(compute, h2d + d2h)
            return window

        nxt = np.arange(1, W + 1)
        h2d_f = U[nxt] * o[nxt] + late
        fwd_x = bwd_x = None
        if self.dx:
            Ux = self.Ux[: W + 1] if C else np.zeros(W + 1, dtype=np.int64)
            Gx = self.Gx[: W + 1] if C else np.zeros(W + 1, dtype=np.int64)
            SIx = (sw * self.six) @ self.ind
            h2d_bx = np.zeros_like(SIx)
            if W > 1:
                h2d_bx[:, 1:] = SIx[:, :-1] + (Ux[: W - 1] * need[: W - 1])
            fwd_x = (np.broadcast_to(Ux[nxt] * o[nxt] + late_x, SO.shape), (sw * self.sox) @ self.ind)
            bwd_x = (h2d_bx, np.broadcast_to(Gx[nxt] * o[nxt], SIx.shape))
        Tf = combine(self.F, h2d_f, SO, fwd_x)
        if nb == 1:
            serial = o[:W] * o[nxt]
            Tf = np.maximum(Tf, np.where(serial == 1, self.F + U[nxt], 0))
            Tf = np.maximum(Tf, np.where(late > 0, self.F + late, 0))
        fwd = U[0] * o[0] + Tf.sum(axis=1)

        compute = self.Bk + REC
        h2d_b = np.zeros_like(SI)
        if W > 1:
            h2d_b[:, 1:] = SI[:, :-1] + (U[: W - 1] * need[: W - 1])
        d2h_b = G[nxt] * o[nxt]
        Tb = combine(compute, h2d_b, d2h_b, bwd_x)
        if nb == 1 and W > 1:
            serial_b = np.zeros(W, dtype=np.int64)
            serial_b[1:] = o[1:W] * o[: W - 1]
            Tb = np.maximum(Tb, np.where(serial_b == 1, compute + np.concatenate([[0], U[: W - 1]]), 0))
        head = (U[C - 1] * need[C - 1] if C else 0) + SI[:, W - 1]
        bwd = head + Tb.sum(axis=1)
        dones = head[:, None] + np.cumsum(Tb[:, ::-1], axis=1)[:, ::-1]
        if C:
            oc = o[:C]
            queued = np.cumsum(self.H * oc)
            host_end = np.maximum(0, (dones[:, :C] + (self.G[:C] * oc + queued)[None, :]).max(axis=1))
            dev_opt = int((self.D * (1 - oc)).sum())
        else:
            host_end, dev_opt = np.zeros(modes.shape[0], dtype=np.int64), 0
        host_total = int((self.H * o[:C]).sum()) if C else 0
        if not overlap:
            host_end = bwd + dev_opt + (int(self.G[0] * o[0]) if C else 0) + host_total
        validate = tuple(int(v) * int(x) for v, x in zip(self.V, o[:C], strict=True))
        iteration: np.ndarray = (
            fwd
            + after_backward_ns(bwd + dev_opt, host_end, validate)
            + (host_total if self.inst.redo_host_steps else 0)
        )
        return iteration

    def _sharded(
        self, offloaded: tuple[bool, ...], nb: int, modes: np.ndarray, sharded: tuple[bool, ...]
    ) -> np.ndarray:
        """The multi-rank windows (module docstring, "Multi-rank jobs"), vectorised over mode rows."""
        inst, C, W = self.inst, self.C, self.W
        d = Decision(offloaded, nb, (Mode.keep,) * inst.n_blocks, sharded)
        d.check(inst)
        k = chunk_terms(inst, d)
        work, redo = host_queue(inst, k)
        i64 = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
        pad = lambda xs: np.concatenate([i64(xs), np.zeros(W + 1 - C, dtype=np.int64)])  # noqa: E731
        U, RS, G = pad(k.upload), pad(k.reduce), pad(k.grad_offload)
        o = pad(offloaded)
        need = pad([b and not r for b, r in zip(offloaded, residency(offloaded, nb), strict=True)])
        late, _ = self._late_uploads(need, o)
        ck = (modes == Mode.checkpoint).astype(np.int64)
        sw = (modes == Mode.swap).astype(np.int64)
        REC = (ck * self.rec) @ self.ind
        SO = (sw * self.so) @ self.ind
        SI = (sw * self.si) @ self.ind
        overlap, full_duplex = inst.copy_overlap, inst.params.full_duplex
        slow = PERMILLE - inst.collective_overlap_permille

        def copies(h2d: Any, d2h: Any) -> Any:
            return np.maximum(h2d, d2h) if full_duplex else h2d + d2h

        nxt = np.arange(1, W + 1)
        # forward: the single-rank windows (no collectives; sharded chunks are uploaded whole)
        h2d_f = U[nxt] + late
        Tf = np.maximum(self.F, copies(h2d_f, SO)) if overlap else self.F + h2d_f + SO
        if nb == 1:
            Tf = np.maximum(Tf, np.where(o[:W] * o[nxt] == 1, self.F + U[nxt], 0))
            Tf = np.maximum(Tf, np.where(late > 0, self.F + late, 0))
        fwd = U[0] * o[0] + Tf.sum(axis=1)

        compute = self.Bk + REC
        up_b = np.concatenate([[0], U[: W - 1] * need[: W - 1]]) if W > 1 else np.zeros(W, dtype=np.int64)
        si_b = np.zeros_like(SI)
        if W > 1:
            si_b[:, 1:] = SI[:, :-1]
        red, gout = RS[nxt], G[nxt]
        h2d_b = up_b + si_b
        if overlap:
            cp = copies(h2d_b, gout)
            link = np.maximum(
                red + gout,
                np.maximum(
                    -(-(PERMILLE * cp + slow * red) // PERMILLE), -(-(PERMILLE * red + slow * cp) // PERMILLE)
                ),
            )
            Tb = np.maximum(compute, link)
        else:
            Tb = compute + h2d_b + gout + red
        if nb == 1 and W > 1:
            serial_b = np.concatenate([[0], o[1:W] * o[: W - 1]])
            Tb = np.maximum(Tb, np.where(serial_b == 1, compute + np.concatenate([[0], U[: W - 1]]), 0))
        head = (U[C - 1] * need[C - 1] if C else 0) + SI[:, W - 1]
        tail = int(RS[0]) if C else 0
        bwd = head + Tb.sum(axis=1) + tail
        dones = head[:, None] + np.cumsum(Tb[:, ::-1], axis=1)[:, ::-1]
        queue = i64(work)
        dev_opt = sum(k.device_optim)
        if C:
            arrive = dones[:, :C] + ((RS[:C] + G[:C]) * o[:C])[None, :]
            host_end = np.maximum(0, (arrive + np.cumsum(queue)[None, :]).max(axis=1))
        else:
            host_end = np.zeros(modes.shape[0], dtype=np.int64)
        if not overlap:
            host_end = bwd + dev_opt + int(G[0]) + int(queue.sum())
        iteration: np.ndarray = (
            fwd
            + after_backward_ns(bwd + dev_opt, host_end, k.validate)
            + redo
            + sum(k.device_gather)
            + k.control
        )
        return iteration


def iteration_ns_batch(
    inst: PolicyInstance,
    offloaded: tuple[bool, ...],
    n_buffers: int,
    modes: np.ndarray,
    sharded: tuple[bool, ...] = (),
) -> np.ndarray:
    """`evaluate_decision(...).iteration_ns` for every row of `modes` (see `BatchTimer`)."""
    return BatchTimer(inst)(offloaded, n_buffers, modes, sharded)
