"""`profile`: measure a real training iteration of a model and return a wire-contract v1 `Trace`.

The session, in order (every iteration is a real forward, loss, backward and optimizer step):
1. warm-up iteration with first-use hooks: parameter execution order and block mapping; lazy state
   (optimizer moments, allocator caches) is created here, so later iterations are steady-state;
2. `repeats` plain iterations, no hooks: `iteration_s` (median) and the optimizer step time (on CPU with
   its `zero_grad`); under a process group every rank starts each of them together, as the job's ranks
   compute (`lockstep.py`); on a CPU device in a job of several ranks, `repeats` more after step 4 (see
   `late_plain_iterations`), the medians then over both moments;
3. `repeats - 1` (at least 2) hooked iterations: per-block forward and backward seconds (median), then
   calibrated: scaled so that their sum equals the plain iteration's compute time (hook overhead removed);
4. recompute: each repeated block's forward re-run on its captured inputs with grad enabled (what
   checkpointing does during backward); then the runtime's own costs: swap, checkpoint and an offloaded
   chunk on one repeated block (`runtime_probe.py`), and on CPU the persistent-chunk path over every
   parameter (`persistent_probe.py`: the device optimizer throughput is then the runtime's);
5. one tracked iteration: a storage tracker (CPU: `TorchDispatchMode`; CUDA: allocator history) plus
   saved-tensor hooks give per-block activation bytes, input bytes, transient peaks, the peak and the
   allocation trace;
6. host optimizer throughput and the hardware probe (cached per process).
Parameters, gradients, optimizer state and RNG are restored afterwards; every hook, dispatch mode and
allocator history is removed or turned off on return and on error.

Models larger than the device: `max_blocks=k` profiles the prologue, the first k repeated blocks and the
epilogue only (the block list is truncated while profiling) and copies to each other block the figures of
the last profiled block of its kind (same parameter signature; `extrapolation.py` says why the profiled
prefix covers every kind); the trace says so (`measurements.extrapolated`, `profiled_blocks`).

Why one module over 400 lines: `profile` and `_measure` are the session's steps in the order above, read top
to bottom; the steps' work is in `runtime_costs.py`, `memory_tracking.py`, `extrapolation.py` and the probes.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch import nn

from agent.allocator.device_memory import check_history_available
from agent.group_profiling import profile_on_every_rank
from agent.kv_cache import KVCacheOff
from agent.profiler.block_detection import RepeatedBlocks, detect_blocks, edge_name
from agent.profiler.block_marks import BlockTracker, seconds_by_block, segments
from agent.profiler.collectives import probe_for_planning
from agent.profiler.device_clock import DeviceClock
from agent.profiler.extrapolation import block_kinds, blocks_that_fit, covering_prefix, extrapolate, truncated
from agent.profiler.hardware import in_group, probe_hardware
from agent.profiler.hooks import BlockHooks
from agent.profiler.lockstep import Lockstep, meetings
from agent.profiler.memory_tracking import track_memory
from agent.profiler.model_config import hf_config
from agent.profiler.offload_probe import OffloadProbe, probe_offloaded
from agent.profiler.offload_probe import enabled as whole_model_probe_enabled
from agent.profiler.optimizer_probe import (
    host_copy_throughput,
    host_step_overhead,
    host_step_throughput,
    optimizer_kind,
    state_bytes_per_param,
)
from agent.profiler.outside_use import OutsideUse
from agent.profiler.parameters import (
    OrderedParameter,
    dtype_name,
    fingerprint,
    order_parameters,
    parameter_infos,
)
from agent.profiler.persistent_probe import probe_persistent
from agent.profiler.runtime_costs import BlockRuntimeCosts, runtime_costs
from agent.profiler.runtime_probe import RuntimeProbe, probe_block
from agent.profiler.session import (
    LossFn,
    ProfilerInputError,
    TrainingStep,
    check_grad_mode,
    move_batch,
    preserved_training_state,
)
from agent.profiler.tensors import iter_tensors
from agent.runtime.process_group import resolve
from client.contract import (
    AllocationTrace,
    BlockInfo,
    BlockKind,
    BlockMeasurement,
    Distributed,
    Hardware,
    Measurements,
    ModelInfo,
    OptimizerMeasurement,
    Phase,
    Precision,
    Software,
    Trace,
    Workload,
)

log = logging.getLogger(__name__)

REPEATS = 3  # plain iterations per moment (and hooked ones: `repeats - 1`, at least 2) by default


def late_plain_iterations(device: torch.device, world_size: int) -> bool:
    """Whether the profile times its plain iterations at a second moment, after the probes (step 4 of the
    session), and takes the medians over both moments: on a CPU device in a job of several ranks.

    The plain iteration is what every block's forward and backward time is scaled to, so it sets about half of
    a predicted iteration. On the 2-core VMs that run the issue-20 benchmark the same plain iteration measured
    33-59 ms within one run, in spells of seconds (docs/BENCHMARKS.md, session 33): `repeats` iterations in a
    row, ~0.1 s, fall in one spell, and one run's profile timed its plain iterations 18 ms (~40%) above the
    plain iteration timed before its managed run. A second sample after the probes, seconds later, halves what
    one spell can do to the median. Taking the later sample of the 31 saved 2-rank runs of the issue's command
    as the plain iteration timed before each managed run, the configurations within 10% by the median of 3
    went from 160 to 174 of 248 (docs/BENCHMARKS.md, session 33, says how); five runs of the issue's command on
    the AMD EPYC VM then counted 7, 6, 8, 8 and 6 of 8 with it, three without it that day 2, 6 and 7 of 8. The
    cost is `repeats` plain iterations (0.1-0.2 s for the benchmark's models, whose 2-rank `wrap` takes 7-19 s
    on a CPU). Not in
    single-process profiles (issue 3's budget of ~10 iterations per profile, met at 4 of 4 within 10% without
    it) nor on CUDA (a GPU's iteration time does not swing in spells; its iterations are the expensive ones)."""
    return device.type == "cpu" and world_size > 1


_PRECISION = {torch.float32: Precision.fp32, torch.bfloat16: Precision.bf16, torch.float16: Precision.fp16}


def profile(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    blocks: Sequence[nn.Module] | None = None,
    allocation_trace: bool = True,
    max_blocks: int | None = None,
    repeats: int = REPEATS,
    hardware: Hardware | None = None,
    device_memory_limit: int | None = None,
    name: str | None = None,
    distributed: Distributed | None = None,
    process_group: Any = None,
    lockstep: Callable[[], None] | None = None,
) -> Trace:
    """Profile one training iteration of `model` on `sample_batch`; every number in the Trace is measured.

    `optimizer` defaults to AdamW over the trainable parameters (created and discarded here); `device`
    defaults to where the parameters are; `blocks` overrides block detection with the repeated blocks in
    execution order. `max_blocks` profiles only that many repeated blocks and extrapolates to the rest.
    `hardware` reuses an earlier probe; `device_memory_limit` caps the reported device capacity.
    `distributed`: the job's process group as `collectives.probe_process_group` measured it (every rank
    probes; rank 0 profiles and passes it here): the trace then says world size, ranks per node and the
    collectives, and the plan is a multi-rank one (issue 20). `process_group`: the job's `torch.distributed`
    group, as `agent.wrap` takes it, measured here instead (`collectives.probe_for_planning`, sized to rank 0's
    model): then `profile` is a collective call that every rank of the group makes, each profiling its own
    model at the same time (after every rank measured its hardware), and every rank returns the job's trace,
    the slowest rank's, as `agent.wrap` plans (`agent/group_profiling.py`). Not the default group by itself,
    unlike `wrap`: a `profile` called on rank 0 alone must not wait for ranks that never join. When the
    model's states would not fit the device (see `extrapolation.blocks_that_fit`), fewer blocks are profiled
    automatically and the rest extrapolated. `lockstep`: the group's barrier, which the group paths (`wrap`,
    `process_group=`) pass for every rank to start each plain iteration together (`lockstep.py`); every rank
    meets it `lockstep.meetings(repeats)` times, however its profiling ends.
    """
    steps = Lockstep(lockstep, meetings(repeats))
    try:
        check_grad_mode("profile")  # inside: a rank that raises still meets the others (`steps.settle()`)
        return _profile(
            model,
            sample_batch,
            loss_fn=loss_fn,
            optimizer=optimizer,
            device=device,
            blocks=blocks,
            allocation_trace=allocation_trace,
            max_blocks=max_blocks,
            repeats=repeats,
            hardware=hardware,
            device_memory_limit=device_memory_limit,
            name=name,
            distributed=distributed,
            process_group=process_group,
            lockstep=steps,
        )
    finally:
        steps.settle()  # a rank that failed before its plain iterations still meets the others (lockstep.py)


def _profile(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | str | None,
    blocks: Sequence[nn.Module] | None,
    allocation_trace: bool,
    max_blocks: int | None,
    repeats: int,
    hardware: Hardware | None,
    device_memory_limit: int | None,
    name: str | None,
    distributed: Distributed | None,
    process_group: Any,
    lockstep: Lockstep,
) -> Trace:
    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {repeats}")
    if process_group is not None and distributed is not None:
        raise ValueError("process_group: given with distributed= (an earlier probe of the group); give one")
    first = next(iter(model.parameters()), None)
    if first is None:
        raise ProfilerInputError(f"model: {type(model).__name__} has no parameters to profile")
    dev = torch.device(device) if device is not None else first.device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if process_group is not None:
        group = resolve(process_group)  # a group given: resolved, or ValueError naming it
        assert group is not None
        measured = probe_for_planning(group, model)
        probed: list[Hardware] = []

        def prepare() -> None:  # before the start line: no rank profiles beside another's copy probe
            probed.append(hardware if hardware is not None else probe_hardware(dev, device_memory_limit))

        def run(barrier: Callable[[], None]) -> Trace:
            return profile(
                model,
                sample_batch,
                loss_fn=loss_fn,
                optimizer=optimizer,
                device=dev,
                blocks=blocks,
                allocation_trace=allocation_trace,
                max_blocks=max_blocks,
                repeats=repeats,
                hardware=probed[0],
                device_memory_limit=device_memory_limit,
                name=name,
                distributed=measured,
                lockstep=barrier,
            )

        job = profile_on_every_rank(group, run, meetings(repeats), prepare=prepare, every_rank=True)
        assert job is not None  # every_rank: the job's trace on every rank
        return job.trace
    repeated_all = detect_blocks(model, blocks)
    if max_blocks is not None and not 1 <= max_blocks:
        raise ValueError(f"max_blocks: must be at least 1, got {max_blocks}")
    if max_blocks is None:
        max_blocks = blocks_that_fit(model, repeated_all, dev, device_memory_limit)
    elif max_blocks < len(repeated_all) and max_blocks < (need := covering_prefix(block_kinds(repeated_all))):
        raise ValueError(
            f"max_blocks: {max_blocks} profiles no block of the kind (parameter names, shapes, dtypes) that "
            f"{repeated_all.names[need - 1]!r} starts; the blocks differ, so profile at least {need}"
        )
    n_profiled = len(repeated_all) if max_blocks is None else min(max_blocks, len(repeated_all))
    full_fingerprint = fingerprint(model)
    all_params_named = dict(model.named_parameters())

    t_hw = time.perf_counter()
    hw = hardware if hardware is not None else probe_hardware(dev, device_memory_limit)
    hw = in_group(hw, distributed)
    t_hw = time.perf_counter() - t_hw
    with truncated(model, repeated_all, n_profiled) as repeated, _on_device(model, dev, optimizer):
        opt = (
            optimizer
            if optimizer is not None
            else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        )
        kind = optimizer_kind(opt)
        # the parameters the user's optimizer steps (the default one, made over a truncated model, says nothing
        # of the unprofiled blocks: then requires_grad alone says which train)
        held = {id(p) for g in opt.param_groups for p in g["params"]} if optimizer is not None else None
        batch = move_batch(sample_batch, dev)
        with preserved_training_state(model, optimizer), KVCacheOff(model):  # training never uses the cache
            result = _measure(
                model, batch, loss_fn, opt, dev, repeated, allocation_trace, repeats, hw, lockstep
            )
        extrapolated = n_profiled < len(repeated_all)

    ordered = result.ordered
    block_meas = result.blocks
    iteration_s, peak = result.iteration_s, result.peak_bytes
    alloc = result.allocation
    if extrapolated:
        ordered, block_meas, iteration_s, peak = extrapolate(
            repeated_all,
            n_profiled,
            ordered,
            block_meas,
            iteration_s,
            peak,
            all_params_named,
            model_state_bytes_per_byte=result.model_state_bytes_per_param_byte,
        )
        alloc = None  # the trace of a truncated iteration would not be the real one's

    infos = parameter_infos(ordered, held, result.used_outside_owner)
    n_blocks = len(repeated_all) + 2
    per_block = [0] * n_blocks
    paths: list[list[str]] = [[] for _ in range(n_blocks)]
    classes: list[list[str]] = [[] for _ in range(n_blocks)]
    for o, info in zip(ordered, infos, strict=True):
        per_block[info.block] += info.bytes
        if o.module_path not in paths[info.block]:
            paths[info.block].append(o.module_path)
            cls = type(model.get_submodule(o.module_path)).__name__
            if cls not in classes[info.block]:
                classes[info.block].append(cls)
    block_infos = [
        BlockInfo(
            index=0,
            name=edge_name("prologue", paths[0]),
            kind=BlockKind.prologue,
            module_class="+".join(classes[0]) or "none",
            parameter_bytes=per_block[0],
        )
    ]
    for i, (bname, module) in enumerate(zip(repeated_all.names, repeated_all.modules, strict=True)):
        block_infos.append(
            BlockInfo(
                index=i + 1,
                name=bname,
                kind=BlockKind.block,
                module_class=type(module).__name__,
                parameter_bytes=per_block[i + 1],
            )
        )
    block_infos.append(
        BlockInfo(
            index=n_blocks - 1,
            name=edge_name("epilogue", paths[-1]),
            kind=BlockKind.epilogue,
            module_class="+".join(classes[-1]) or "none",
            parameter_bytes=per_block[-1],
        )
    )

    params = [o.param for o in ordered]
    p_dtype = _majority_dtype(params)
    arch = type(model).__name__
    model_info = ModelInfo(
        name=name or model_name(model, len(repeated_all)),
        architecture=arch,
        fingerprint=full_fingerprint,
        parameter_count=sum(p.numel() for p in params),
        dtype=dtype_name(p_dtype),
        blocks=block_infos,
        parameters=infos,
        config=hf_config(model),
    )
    batch_size, seq = _batch_shape(sample_batch)
    if p_dtype not in _PRECISION:
        raise ProfilerInputError(f"model: parameters of dtype {p_dtype} are not fp32, bf16 or fp16")
    workload = Workload(
        batch_size=batch_size,
        sequence_length=seq,
        precision=_PRECISION[p_dtype],
        optimizer=kind,
        optimizer_state_bytes_per_param=result.optimizer_state_bytes_per_param,
        master_bytes_per_param=0,
        gradient_bytes_per_param=result.gradient_bytes_per_param,
    )
    t1 = time.perf_counter()
    host_opt = host_step_throughput()
    host_overhead = host_step_overhead(host_opt)
    host_copy = host_copy_throughput()
    t2 = time.perf_counter()
    log.debug(
        "profile stages (s): %s",
        {
            **result.stages,
            "hardware": t_hw,
            "host_optimizer": t2 - t1,
            "hook_overhead_per_iteration": result.hook_overhead_s,
        },
    )
    measurements = Measurements(
        blocks=block_meas,
        optimizer=OptimizerMeasurement(
            device_bytes_per_s=result.device_opt_bytes_per_s,
            host_bytes_per_s=host_opt,
            host_step_overhead_s=host_overhead,
            host_copy_bytes_per_s=host_copy,
        ),
        iteration_s=iteration_s,
        peak_device_bytes=peak,
        extrapolated=extrapolated,
        profiled_blocks=list(range(n_profiled + 1)) + [n_blocks - 1] if extrapolated else [],
    )
    return Trace(
        hardware=hw,
        software=_software(),
        model=model_info,
        workload=workload,
        measurements=measurements,
        allocation_trace=alloc,
    )


# ------------------------------------------------------------------------------------------- measuring
class _Result:
    ordered: list[OrderedParameter]
    blocks: list[BlockMeasurement]
    iteration_s: float
    peak_bytes: int
    allocation: AllocationTrace | None
    device_opt_bytes_per_s: float
    optimizer_state_bytes_per_param: int
    gradient_bytes_per_param: int
    model_state_bytes_per_param_byte: float
    hook_overhead_s: float
    stages: dict[str, float]
    used_outside_owner: set[int]  # ids of parameters an op used outside their owning module's forward


def _measure(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    opt: torch.optim.Optimizer,
    dev: torch.device,
    repeated: RepeatedBlocks,
    want_trace: bool,
    repeats: int,
    hw: Hardware,
    lockstep: Lockstep,
) -> _Result:
    if dev.type == "cuda":
        check_history_available(dev)  # the planned allocator has no memory history: say so before any work
    clock = DeviceClock(dev)
    n_blocks = len(repeated) + 2
    step = TrainingStep(model, batch, loss_fn, opt, n_blocks)
    res = _Result()

    stages: dict[str, float] = {}
    mark = time.perf_counter()

    def stage(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        stages[name] = now - mark
        mark = now

    # 1. warm-up with first-use hooks
    block_tracker = BlockTracker(clock)
    # and the parameters an op uses outside their owning module's forward (never sharded on the device)
    with OutsideUse(model) as outside, BlockHooks(model, repeated, block_tracker, first_use=True) as hooks:
        step.run(block_tracker)
        first_use = list(hooks.param_order)
        uses = dict(hooks.param_uses)
    res.ordered = order_parameters(model, repeated, first_use, uses)
    res.used_outside_owner = outside.outside
    stepped = [p for p in model.parameters() if p.grad is not None]
    if not stepped:
        raise ProfilerInputError("loss_fn: the loss reaches no parameter (no gradients after backward)")
    sparse = next((n for n, p in model.named_parameters() if p.grad is not None and p.grad.is_sparse), None)
    if sparse is not None:
        raise ProfilerInputError(
            f"model: parameter {sparse!r} has a sparse gradient (an embedding with sparse=True?); memplan keeps "
            "every gradient dense: build the module with dense gradients"
        )
    grad_elt = stepped[0].grad.element_size()  # type: ignore[union-attr]
    res.gradient_bytes_per_param = grad_elt
    res.optimizer_state_bytes_per_param = state_bytes_per_param(opt, stepped)
    stepped_bytes = sum(p.numel() * p.element_size() for p in stepped)
    res.model_state_bytes_per_param_byte = 1.0 + (grad_elt + res.optimizer_state_bytes_per_param) / max(
        1, stepped[0].element_size()
    )

    stage("warmup")

    # 2. plain iterations
    totals, steps, zeros = [], [], []
    peak_plain: int | None = None

    def plain() -> None:
        nonlocal peak_plain
        for i in range(repeats):
            if dev.type == "cuda" and i == repeats - 1:
                torch.cuda.reset_peak_memory_stats(dev)
            lockstep.meet()  # under a group: every rank starts this iteration together, as in the job
            total, step_s, zero_s = step.timed(clock)
            totals.append(total)
            steps.append(step_s)
            zeros.append(zero_s)
            if dev.type == "cuda" and i == repeats - 1:
                peak_plain = int(torch.cuda.max_memory_allocated(dev))

    plain()
    stage("plain")

    # 3. hooked timing iterations (inputs captured on the last one, for recompute)
    n_hooked = max(2, repeats - 1)
    fwd_runs: list[list[float]] = []
    bwd_runs: list[list[float]] = []
    hooked_walls: list[float] = []
    captured: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    for r in range(n_hooked):
        block_tracker = BlockTracker(clock)
        with BlockHooks(model, repeated, block_tracker) as hooks:
            hooks.keep_inputs = r == n_hooked - 1
            step.run(block_tracker)
            captured = dict(hooks.block_inputs)
        segs = segments(block_tracker.marks)
        fwd_runs.append(seconds_by_block(segs, n_blocks, Phase.forward))
        bwd_runs.append(seconds_by_block(segs, n_blocks, Phase.backward))
        hooked_walls.append(block_tracker.marks[-1].time_s - block_tracker.marks[0].time_s)
    fwd = [statistics.median(run[b] for run in fwd_runs) for b in range(n_blocks)]
    bwd = [statistics.median(run[b] for run in bwd_runs) for b in range(n_blocks)]

    stage("hooked")

    # 4. recompute: each repeated block's forward re-run on its captured inputs, grad enabled
    recompute = [0.0] * n_blocks
    for idx, (args, kwargs) in captured.items():
        module = repeated.modules[idx - 1]
        with torch.enable_grad():
            t0 = clock.now()
            out = module(*args, **kwargs)
            t1 = clock.now()
        del out
        recompute[idx] = t1 - t0

    stage("recompute")

    # 4b. the runtime's own costs (swap, checkpoint, offloaded chunk) on one repeated block
    probe: RuntimeProbe | None = None
    probed = 0
    if captured:
        probed = sorted(captured)[len(captured) // 2]
        args, kwargs = captured[probed]
        try:
            probe = probe_block(repeated.modules[probed - 1], args, kwargs, dev, probed, opt)
        except (TypeError, ValueError):
            raise  # a bug (the agent's or the model's), not a missing measurement
        except Exception as e:  # e.g. a block whose captured inputs carry state (a KV cache it appends to)
            log.warning(
                "runtime probe skipped (%s: %s): the trace has no measured runtime costs, the cost "
                "model charges copies by bandwidth",
                type(e).__name__,
                e,
            )
            probe = None
    captured.clear()

    stage("runtime_probe")

    # 4c. CPU: the chunk runtime's persistent-chunk path (gradient hooks, chunked step, zero_grad) over every
    # parameter, as the device optimizer's throughput (a GPU keeps the plain step's: copies and the optimizer
    # overlap compute there, and its runtime costs are not charged)
    persistent = None
    if dev.type == "cpu":
        try:
            persistent = probe_persistent(model, res.ordered, opt, dev)
        except (TypeError, ValueError):
            raise  # a bug (the agent's or the model's), not a missing measurement
        except Exception as e:
            log.warning(
                "persistent-chunk probe skipped (%s: %s): the device optimizer throughput is the plain "
                "step's",
                type(e).__name__,
                e,
            )
            persistent = None

    stage("persistent_probe")

    # 4d. CPU, in jobs of several ranks (`offload_probe.py`: not in single-process ones, for its profile time):
    # the whole model with every chunk offloaded, the scale of the runtime probe's chunk costs
    whole: OffloadProbe | None = None
    if dev.type == "cpu" and probe is not None and whole_model_probe_enabled(hw.world_size):
        try:
            whole = probe_offloaded(model, res.ordered, step, opt, dev)
        except (TypeError, ValueError):
            raise  # a bug (the agent's or the model's), not a missing measurement
        except Exception as e:
            log.warning(
                "offloaded whole-model probe skipped (%s: %s): chunk costs are the one block's, unscaled",
                type(e).__name__,
                e,
            )

    stage("offload_probe")

    # 4e. CPU, in jobs of several ranks: the plain iterations again, a second moment (`late_plain_iterations`)
    if late_plain_iterations(dev, hw.world_size):
        plain()
    stage("late_plain")
    res.iteration_s = statistics.median(totals)
    opt_step_s = statistics.median(steps)
    # CPU: the optimizer's calls (step and zero_grad) are charged by the device optimizer throughput, not
    # spread over the blocks (the chunk runtime replaces both by its own, measured in 4c)
    zero_grad_s = statistics.median(zeros) if dev.type == "cpu" else 0.0
    if persistent is not None and persistent.total_s > 0:  # (CPU: 4c) the runtime's own step and zero_grad
        res.device_opt_bytes_per_s = persistent.stepped_bytes / persistent.total_s
        log.debug(
            "persistent chunks: %s (plain step %.4fs, zero_grad %.4fs)", persistent, opt_step_s, zero_grad_s
        )
    else:
        res.device_opt_bytes_per_s = stepped_bytes / max(opt_step_s + zero_grad_s, 1e-9)
    # every block's forward and backward scaled so that they add up to the plain iteration's compute
    compute_plain = max(res.iteration_s - opt_step_s - zero_grad_s, 0.0)
    hooked_sum = sum(fwd) + sum(bwd)
    scale = compute_plain / hooked_sum if hooked_sum > 0 else 1.0
    res.hook_overhead_s = statistics.median(hooked_walls) - res.iteration_s
    log.debug(
        "hooked iteration %.4fs vs plain %.4fs; per-block times scaled by %.3f",
        statistics.median(hooked_walls),
        res.iteration_s,
        scale,
    )
    recompute[0], recompute[-1] = fwd[0] * scale, fwd[-1] * scale  # edges are not checkpointed: their forward

    # 5. tracked iteration: memory (after recompute, so no captured input is alive during it)
    act, inp, fwd_tr, bwd_tr, peak, alloc = track_memory(
        model, step, opt, batch, dev, repeated, res.ordered, want_trace
    )
    res.peak_bytes = peak_plain if peak_plain is not None else peak
    res.allocation = alloc
    stage("tracked")
    res.stages = stages

    zero = [0.0] * n_blocks
    costs = BlockRuntimeCosts(zero, zero, recompute, zero, zero, zero, zero)
    if probe is not None:
        costs = runtime_costs(probe, probed, act, recompute, res.ordered, hw, whole)
    res.blocks = [
        BlockMeasurement(
            block=b,
            forward_s=fwd[b] * scale,
            backward_s=bwd[b] * scale,
            recompute_s=costs.recompute[b],
            activation_bytes=act[b],
            input_bytes=inp[b],
            forward_transient_peak_bytes=fwd_tr[b],
            backward_transient_peak_bytes=bwd_tr[b],
            swap_out_s=costs.swap_out[b],
            swap_in_s=costs.swap_in[b],
            offload_overhead_s=costs.offload[b],
            upload_overhead_s=costs.upload[b],
            offload_forward_s=costs.offload_forward[b],
            offload_step_s=costs.offload_step[b],
        )
        for b in range(n_blocks)
    ]
    return res


# ------------------------------------------------------------------------------------------- helpers
@contextmanager
def _on_device(
    model: nn.Module, dev: torch.device, optimizer: torch.optim.Optimizer | None
) -> Iterator[None]:
    """Move the (possibly truncated) model to `dev` for profiling, and back afterwards."""
    devices = {p.device for p in model.parameters()}
    if devices == {dev}:
        yield
        return
    if optimizer is not None:
        raise ProfilerInputError(
            f"device: the model's parameters are on {sorted(map(str, devices))}, not {dev}; move the model to the "
            "device before creating its optimizer, or pass optimizer=None to profile with a fresh AdamW"
        )
    home = next(iter(model.parameters())).device
    model.to(dev)
    try:
        yield
    finally:
        model.to(home)


def _majority_dtype(params: list[nn.Parameter]) -> torch.dtype:
    by: dict[torch.dtype, int] = {}
    for p in params:
        by[p.dtype] = by.get(p.dtype, 0) + p.numel()
    return max(by, key=lambda d: by[d])


def model_name(model: nn.Module, n_blocks: int) -> str:
    """The one name of a model, whoever profiles it (`agent.wrap`, `memplan profile`, the demo, a zoo model):
    class, repeated blocks and hidden size, e.g. `Qwen2ForCausalLM-8L-512H`."""
    hidden = _hidden_size(model)
    return f"{type(model).__name__}-{n_blocks}L" + (f"-{hidden}H" if hidden else "")


def _hidden_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    h = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    return int(h) if isinstance(h, int) else None


def _batch_shape(batch: Any) -> tuple[int, int]:
    """(batch size, sequence length) from `input_ids` if present, else the first tensor of the batch."""
    t = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(t, torch.Tensor):
        t = next(iter_tensors(batch), None)
    if t is None or t.dim() == 0:
        raise ProfilerInputError("sample_batch: holds no tensor with a batch dimension")
    return int(t.shape[0]), int(t.shape[1]) if t.dim() > 1 else 1


def _software() -> Software:

    try:
        memplan_version = version("memplan")
    except PackageNotFoundError:
        memplan_version = "unknown"
    return Software(
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        python_version=sys.version.split()[0],
        memplan_version=memplan_version,
    )
