"""CP-SAT model of the memory-policy decision for one chunk layout: the cost model as linear constraints.

Every integer is in the units of `PolicyInstance`: times in nanoseconds, memory in bytes. Each
`_add_*` function adds one family of constraints; `build` composes them. The model encodes exactly the
formulas of `cost_model.py` (each max() becomes lower bounds on a window variable that the objective
pushes down), so at the optimum the objective equals `evaluate_decision` of the extracted decision.

Decision variables
  mode[b] in {keep, checkpoint, swap}  (booleans keep/ckpt/swap, exactly one; prologue/epilogue fixed keep)
  off[c]  chunk c offloaded (else persistent)
  res[c]  offloaded chunk c still in a buffer after forward (allowed iff fewer than n_buffers offloaded after it)
  nbuf    number of device buffers, 0..#offloaded, >= 1 when anything is offloaded, and >= the offloaded
          chunks of every co-needed set (`PolicyInstance.co_needed`: a module spanning chunks)
  nbuf1   nbuf == 1 (one buffer: no prefetch between two offloaded chunks)
Multi-rank jobs (world size > 1; `_add_time_sharded`, cost_model "Multi-rank jobs"):
  sh[c]   chunk c sharded across the ranks. osh[c] = sh[c] AND off[c] (offloaded, ZeRO-2 on the host: the rows
          below); dsh[c] = sh[c] - osh[c] (persistent, sharded on the device: ZeRO-3, only where the instance has
          device-shard terms, else sh[c] <= off[c]). off[c] - osh[c] is an offloaded replicated chunk,
          1 - osh[c] one whose gradient is all-reduced (a persistent one as backward completes it, device-sharded
          or not: policy-1.13). Uploads, residency and
          buffers are the single-process ones (a sharded chunk is uploaded whole).
          dsh[c]: device bytes `device_shard_bytes_of` instead of `state_bytes`, the shard's device step, the
          exposed all-gathers (`cost_model.device_gather_exposed_ns`) added to the iteration, and twice the
          largest gathered copy (gmax >= gathered bytes * dsh[c]) added to the static device bytes.
  any_sh  some chunk is sharded (any_sh >= osh[c]): node-shared compute copies pay one barrier per step
          (`PolicyInstance.step_barrier_ns`; only when that is non-zero)
  any_off, any_per, any_dsh  some chunk offloaded / persistent / device-sharded (each pinned to its maximum
          both ways): the runtime's control checks at a phase's end, `phase_control_ns` each, and the
          device-shard agreements before each all-gather, `control_ns` each (`cost_model.control_checks_ns`)
At world size 1 none of these exist and the model is the single-process one, row for row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from planner_service.solver.cost_model import device_gather_exposed_ns, residency
from planner_service.solver.instance import Decision, Mode, PolicyInstance
from planner_service.solver.sharding import PERMILLE

LinearExpr = cp_model.LinearExpr | int  # a CP-SAT linear expression or a constant (units per use)


@dataclass
class PolicyModel:
    """A built CP-SAT model and the handles needed to hint it and read a decision back."""

    model: cp_model.CpModel
    inst: PolicyInstance
    keep: list[LinearExpr] = field(default_factory=list)
    ckpt: list[LinearExpr] = field(default_factory=list)
    swap: list[LinearExpr] = field(default_factory=list)
    off: list[cp_model.IntVar] = field(default_factory=list)
    res: list[cp_model.IntVar] = field(default_factory=list)
    nbuf: cp_model.IntVar | None = None
    nbuf1: cp_model.IntVar | None = None
    iteration: cp_model.IntVar | None = None
    peak: cp_model.IntVar | None = None
    pairs: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    sh: list[cp_model.IntVar] = field(default_factory=list)  # multi-rank only: sharded (either placement)
    osh: list[LinearExpr] = field(default_factory=list)  # offloaded and sharded
    dsh: list[LinearExpr] = field(default_factory=list)  # persistent and sharded on the device (else 0)

    def decision(self, solver: cp_model.CpSolver) -> Decision:
        assert self.nbuf is not None
        modes = []
        for b in range(self.inst.n_blocks):
            if solver.value(self.ckpt[b]):
                modes.append(Mode.checkpoint)
            elif solver.value(self.swap[b]):
                modes.append(Mode.swap)
            else:
                modes.append(Mode.keep)
        return Decision(
            offloaded=tuple(bool(solver.value(v)) for v in self.off),
            n_buffers=int(solver.value(self.nbuf)),
            modes=tuple(modes),
            sharded=tuple(bool(solver.value(v)) for v in self.sh),
        )

    def hint(self, d: Decision) -> None:
        """Hint the decision variables (the derived integers are left to the solver's propagation)."""

        m = self.model
        assert self.nbuf is not None and self.nbuf1 is not None
        for b, mode in enumerate(d.modes):
            for expr, want in (
                (self.keep[b], Mode.keep),
                (self.ckpt[b], Mode.checkpoint),
                (self.swap[b], Mode.swap),
            ):
                if isinstance(expr, cp_model.IntVar):
                    m.add_hint(expr, int(mode == want))
        res = residency(d.buffered(self.inst), d.n_buffers)
        for c, v in enumerate(self.off):
            m.add_hint(v, int(d.offloaded[c]))
            m.add_hint(self.res[c], int(res[c]))
        for c, v in enumerate(self.sh):
            m.add_hint(v, int(d.sharded_chunks(self.inst)[c]))
        m.add_hint(self.nbuf, d.n_buffers)
        m.add_hint(self.nbuf1, int(d.n_buffers == 1))


def _add_modes(pm: PolicyModel) -> None:
    m, inst = pm.model, pm.inst
    for b in range(inst.n_blocks):
        if not inst.optimisable[b]:
            pm.keep.append(1)
            pm.ckpt.append(0)
            pm.swap.append(0)
            continue
        k, c, s = (m.new_bool_var(f"{n}[{b}]") for n in ("keep", "ckpt", "swap"))
        m.add_exactly_one(k, c, s)
        pm.keep.append(k)
        pm.ckpt.append(c)
        pm.swap.append(s)


def _add_placement(pm: PolicyModel) -> None:
    """off/res/nbuf and the residency rule: res[c] needs fewer than nbuf offloaded chunks after c."""
    m, C = pm.model, pm.inst.n_chunks
    pm.off = [m.new_bool_var(f"off[{c}]") for c in range(C)]
    pm.res = [m.new_bool_var(f"res[{c}]") for c in range(C)]
    pm.nbuf = m.new_int_var(0, C, "nbuf")
    pm.nbuf1 = m.new_bool_var("nbuf1")
    m.add(pm.nbuf == 1).only_enforce_if(pm.nbuf1)
    m.add(pm.nbuf != 1).only_enforce_if(~pm.nbuf1)
    if pm.inst.sharded_job:
        pm.sh = [m.new_bool_var(f"sh[{c}]") for c in range(C)]
        if pm.inst.device_shard_bytes_of:  # a persistent chunk may be sharded on the device (ZeRO-3)
            for c in range(C):
                o = m.new_bool_var(f"osh[{c}]")
                m.add(o <= pm.sh[c])
                m.add(o <= pm.off[c])
                m.add(o >= pm.sh[c] + pm.off[c] - 1)
                pm.osh.append(o)
                pm.dsh.append(pm.sh[c] - o)
                if not pm.inst.device_shardable(c):  # used outside its owner's forward: never on the device
                    m.add(pm.sh[c] <= pm.off[c])
        else:  # only offloaded chunks are sharded
            for c in range(C):
                m.add(pm.sh[c] <= pm.off[c])
            pm.osh = list(pm.sh)
            pm.dsh = [0] * C
    buf = pm.off
    m.add(pm.nbuf <= sum(buf))
    for cs in pm.inst.co_needed:  # a module spanning chunks needs its offloaded ones in buffers at once
        m.add(sum(buf[c] for c in cs) <= pm.nbuf)
    # after[c] = number of buffered chunks after c (a chain keeps the model linear in C, not quadratic)
    after: LinearExpr = 0
    for c in range(C - 1, -1, -1):
        m.add(pm.nbuf >= 1).only_enforce_if(buf[c])
        m.add_implication(pm.res[c], buf[c])
        if c + 1 < C:
            # buffered chunks after c, plus c itself, must all fit in the buffers
            m.add(after + 1 <= pm.nbuf).only_enforce_if(pm.res[c])
        count = m.new_int_var(0, C - c, f"offloaded_from[{c}]")
        m.add(count == after + buf[c])
        after = count


Terms = list[tuple[int, LinearExpr]]  # (coefficient, 0/1 expression) pairs


def _window_terms(pm: PolicyModel) -> tuple[list[int], list[int], list[Terms], list[Terms], list[Terms]]:
    """Per window: forward compute, backward compute (constants, ns); recompute, swap-out, swap-in terms."""
    inst = pm.inst
    W = max(inst.n_chunks, 1)
    F, Bk = [0] * W, [0] * W
    rec: list[Terms] = [[] for _ in range(W)]
    so: list[Terms] = [[] for _ in range(W)]
    si: list[Terms] = [[] for _ in range(W)]
    for b, w in enumerate(inst.layout.chunk_of_block):
        F[w] += inst.fwd_ns[b]
        Bk[w] += inst.bwd_ns[b]
        if inst.optimisable[b]:
            rec[w].append((inst.rec_ns[b], pm.ckpt[b]))
            so[w].append((inst.swap_out_ns[b], pm.swap[b]))
            si[w].append((inst.swap_in_ns[b], pm.swap[b]))
    return F, Bk, rec, so, si


def _duplex_swap_terms(pm: PolicyModel) -> tuple[list[Terms], list[Terms]]:
    """Per window: swap-out and swap-in terms at the concurrent copy rates (`inst.duplex`)."""
    inst = pm.inst
    W = max(inst.n_chunks, 1)
    so: list[Terms] = [[] for _ in range(W)]
    si: list[Terms] = [[] for _ in range(W)]
    for b, w in enumerate(inst.layout.chunk_of_block):
        if inst.optimisable[b]:
            so[w].append((inst.swap_out_duplex_ns[b], pm.swap[b]))
            si[w].append((inst.swap_in_duplex_ns[b], pm.swap[b]))
    return so, si


def _total(terms: Terms) -> LinearExpr:
    return sum(a * x for a, x in terms)


def _add_window(
    m: cp_model.CpModel,
    t: cp_model.IntVar,
    compute: int,
    extra: Terms,
    h2d: Terms,
    d2h: Terms,
    full_duplex: bool,
    copy_overlap: bool = True,
    both_ways: tuple[Terms, Terms] | None = None,
) -> None:
    """t >= max(compute + recompute, H2D copies, D2H copies) (or H2D + D2H on a half-duplex link).

    `both_ways` (full duplex): the same H2D and D2H terms at the concurrent copy rates, charged when a copy
    runs each way: a 0/1 `both` >= h + d - 1 for every pair of non-zero H2D and D2H terms, and t >= each
    concurrent total enforced by `both` (the objective keeps `both` at 0 unless a pair forces it).

    Plus, for every single copy term a*x, the cut t >= compute + (a - compute) * x when a > compute: valid
    because t >= max(compute, a*x) for x in {0, 1}, and it is the convex hull of that max. Without it the
    LP relaxation hides a fractional offload entirely behind compute, and the bound stays weak.
    Without copy overlap (CPU), the window is serial: t >= compute + recompute + H2D + D2H (already linear).
    """
    if not copy_overlap:
        m.add(t >= compute + _total(extra) + _total(h2d) + _total(d2h))
        return
    m.add(t >= compute + _total(extra))
    if full_duplex:
        m.add(t >= _total(h2d))
        m.add(t >= _total(d2h))
        ups, downs = [x for a, x in h2d if a > 0], [x for a, x in d2h if a > 0]
        if both_ways is not None and ups and downs:
            both = m.new_bool_var("both_ways")
            for up in ups:
                for down in downs:
                    m.add(both >= up + down - 1)
            m.add(t >= _total(both_ways[0])).only_enforce_if(both)
            m.add(t >= _total(both_ways[1])).only_enforce_if(both)
    else:
        m.add(t >= _total(h2d) + _total(d2h))
    for a, x in h2d + d2h:
        if a > compute:
            m.add(t >= compute + (a - compute) * x)


def _serial_pair(pm: PolicyModel, a: int, b: int) -> cp_model.IntVar:
    """A 0/1 variable forced to 1 when chunks a and b are both offloaded and there is one buffer.

    Written as pair >= off[a] + off[b] + nbuf1 - 2 (a plain linear row, not an enforced constraint), so
    the LP relaxation sees the serialisation cost of a single buffer; the objective pushes it to 0 otherwise.
    """
    assert pm.nbuf1 is not None
    key = (min(a, b), max(a, b))
    if key not in pm.pairs:
        pair = pm.model.new_bool_var(f"serial[{key[0]},{key[1]}]")
        pm.model.add(pair >= pm.off[a] + pm.off[b] + pm.nbuf1 - 2)
        pm.pairs[key] = pair
    return pm.pairs[key]


@dataclass
class LateUseTerms:
    """The tied chunks' extra uploads (`late_uses.py`, cost_model "late uses"), as terms of the windows.

    late[c] = off[c] - res[c] for a chunk with a use in a later window (a 0/1 expression). Per forward window:
    the re-upload of every such chunk it uses (`forward`; `forward_x` at the concurrent rates) and, with one
    buffer, the same uploads serial with the window's compute (`serial`: y >= late[c] + nbuf1 - 1). Per chunk,
    `displaced[c]` (0/1): uploaded again for backward because a re-uploaded tied chunk took its buffer, with
    any_late >= late[c], first[c] = OR(res[0..c]) bounded above by the chain first[c] <= first[c-1] + res[c],
    displaced[c] >= res[c] - first[c-1] + any_late - 1. Every one only adds time, so the objective pushes it to
    its lower bound: at the optimum each equals the cost model's value."""

    forward: list[Terms]
    forward_x: list[Terms]
    serial: list[Terms]
    displaced: list[LinearExpr]
    bound: int  # upper bound of their time in one iteration (ns)


def _late_use_terms(pm: PolicyModel, upload: tuple[int, ...], upload_x: tuple[int, ...]) -> LateUseTerms:
    inst, m = pm.inst, pm.model
    C, W = inst.n_chunks, max(inst.n_chunks, 1)
    assert pm.nbuf1 is not None
    terms = LateUseTerms([[] for _ in range(W)], [[] for _ in range(W)], [[] for _ in range(W)], [0] * C, 0)
    if not inst.late_uses:
        return terms
    late = {c: pm.off[c] - pm.res[c] for c, _ in inst.late_uses}
    for c, w in inst.late_uses:
        terms.forward[w].append((upload[c], late[c]))
        if upload_x:
            terms.forward_x[w].append((upload_x[c], late[c]))
        if inst.copy_overlap:  # serial windows already pay every upload: no one-buffer row
            y = m.new_bool_var(f"late_serial[{c},{w}]")
            m.add(y >= late[c] + pm.nbuf1 - 1)
            terms.serial[w].append((upload[c], y))
    any_late = m.new_bool_var("any_late")
    for x in late.values():
        m.add(any_late >= x)
    before: LinearExpr = 0  # OR of res[0..c-1]
    for c in range(C):
        displaced = m.new_bool_var(f"displaced[{c}]")
        m.add(displaced >= pm.res[c] - before + any_late - 1)
        terms.displaced[c] = displaced
        first = m.new_bool_var(f"resident_upto[{c}]")
        m.add(first <= before + pm.res[c])
        before = first
    terms.bound = sum(upload[c] for c, _ in inst.late_uses) + max(upload, default=0)
    return terms


def _displaced(lt: LateUseTerms, upload: tuple[int, ...], c: int) -> Terms:
    """Chunk c's upload for backward when a tied chunk displaced it (no term in a model without tied chunks)."""
    return [(upload[c], lt.displaced[c])] if lt.bound else []


def _add_time(pm: PolicyModel) -> None:
    """Forward and backward windows, optimizer terms and the iteration-time objective (all in ns)."""
    if pm.inst.sharded_job:
        _add_time_sharded(pm)
        return
    m, inst = pm.model, pm.inst
    C, W = inst.n_chunks, max(inst.n_chunks, 1)
    U, G = inst.upload_ns, inst.grad_offload_ns
    duplex = inst.params.full_duplex
    overlap = inst.copy_overlap
    assert pm.nbuf1 is not None
    F, Bk, REC, SO, SI = _window_terms(pm)
    lt = _late_use_terms(pm, U, inst.upload_duplex_ns)
    upper = (
        sum(inst.fwd_ns)
        + sum(inst.bwd_ns)
        + sum(inst.rec_ns)
        + sum(inst.swap_out_ns)
        + sum(inst.swap_in_ns)
        + sum(U) * 2
        + lt.bound
        + sum(G)
        + sum(inst.device_optim_ns)
        + sum(inst.host_optim_ns) * 2
    )
    if inst.duplex:  # a window may charge its copies at the (slower) concurrent rates instead
        upper += (
            sum(inst.swap_out_duplex_ns)
            + sum(inst.swap_in_duplex_ns)
            + sum(inst.upload_duplex_ns) * 2
            + (
                sum(inst.upload_duplex_ns[c] for c, _ in inst.late_uses)
                + max(inst.upload_duplex_ns, default=0)
            )
            + sum(inst.grad_offload_duplex_ns)
        )

    def off(c: int) -> Terms:
        return [(U[c], pm.off[c])] if 0 <= c < C else []

    def need(c: int) -> Terms:  # not in a buffer after forward, or displaced by a tied chunk: uploaded again
        return [(U[c], pm.off[c] - pm.res[c]), *_displaced(lt, U, c)] if 0 <= c < C else []

    def grad(c: int) -> Terms:
        return [(G[c], pm.off[c])] if 0 <= c < C else []

    # the same copies at the concurrent rates, for windows that copy both ways (`inst.duplex`)
    dx = inst.duplex
    SOx, SIx = _duplex_swap_terms(pm) if dx else (SO, SI)
    Ux, Gx = inst.upload_duplex_ns, inst.grad_offload_duplex_ns

    def off_x(c: int) -> Terms:
        return [(Ux[c], pm.off[c])] if 0 <= c < C else []

    def need_x(c: int) -> Terms:
        return [(Ux[c], pm.off[c] - pm.res[c]), *_displaced(lt, Ux, c)] if 0 <= c < C else []

    def grad_x(c: int) -> Terms:
        return [(Gx[c], pm.off[c])] if 0 <= c < C else []

    # forward
    tf = [m.new_int_var(F[c], upper, f"tf[{c}]") for c in range(W)]
    for c in range(W):
        both = (off_x(c + 1) + lt.forward_x[c], SOx[c]) if dx else None
        _add_window(m, tf[c], F[c], [], off(c + 1) + lt.forward[c], SO[c], duplex, overlap, both)
        if overlap and c + 1 < C:  # serial windows already pay every upload
            m.add(tf[c] >= F[c] + U[c + 1] * _serial_pair(pm, c, c + 1))
        if overlap and lt.serial[c]:
            m.add(tf[c] >= F[c] + _total(lt.serial[c]))
    fwd = _total(off(0)) + sum(tf)

    # backward
    tb = [m.new_int_var(Bk[c], upper, f"tb[{c}]") for c in range(W)]
    for c in range(W):
        h2d = (need(c - 1) + SI[c - 1]) if c >= 1 else []
        both = (((need_x(c - 1) + SIx[c - 1]) if c >= 1 else []), grad_x(c + 1)) if dx else None
        _add_window(m, tb[c], Bk[c], REC[c], h2d, grad(c + 1), duplex, overlap, both)
        if overlap and 1 <= c < C:
            m.add(tb[c] >= Bk[c] + _total(REC[c]) + U[c - 1] * _serial_pair(pm, c - 1, c))
    head = _total(need(C - 1) + SI[W - 1])
    bwd = head + sum(tb)

    # optimizer: device steps for persistent chunks; one FIFO host worker for offloaded chunks
    dev_opt = sum(inst.device_optim_ns[c] * (1 - pm.off[c]) for c in range(C))
    # clipping redoes the speculative host steps at optimizer.step(), after backward (cost_model: T_host_redo)
    redo = sum(inst.host_optim_ns[c] * pm.off[c] for c in range(C)) if inst.redo_host_steps else 0
    if not overlap:
        # serial (CPU): chunk 0's gradient copy and the host optimizer's work follow backward and the
        # device optimizer (cost_model: T_iter = T_fwd + T_bwd + T_dev_opt + o[0]*G[0] + host work)
        host_work = sum(inst.host_optim_ns[c] * pm.off[c] for c in range(C)) + (G[0] * pm.off[0] if C else 0)
        pm.iteration = m.new_int_var(0, upper * 2, "iteration_ns")
        m.add(pm.iteration == fwd + bwd + dev_opt + host_work + redo)
        return
    host_end = m.new_int_var(0, upper, "host_end")
    dones = _backward_done(m, head, tb, upper)
    queued: LinearExpr = 0  # host optimizer work of offloaded chunks 0..c (ns), as a chain of variables
    total_host = sum(inst.host_optim_ns)
    for c in range(C):
        q = m.new_int_var(0, total_host, f"host_queued[{c}]")
        m.add(q == queued + inst.host_optim_ns[c] * pm.off[c])
        queued = q
        m.add(host_end >= dones[c] + G[c] * pm.off[c] + queued)

    tail = m.new_int_var(0, upper, "after_forward")
    _add_settled(pm, tail, bwd + dev_opt, host_end, [[(inst.validate(c), pm.off[c])] for c in range(C)])
    pm.iteration = m.new_int_var(0, upper * 2, "iteration_ns")
    m.add(pm.iteration == fwd + tail + redo)


def _add_settled(
    pm: PolicyModel,
    after: cp_model.IntVar,
    bwd_dev_opt: LinearExpr,
    host_end: cp_model.IntVar,
    checks: list[Terms],
) -> None:
    """`cost_model.after_backward_ns` as rows: after >= backward + device steps + every offloaded chunk's check
    of its exposed `.grad` (`checks[c]`: (ns, indicator) pairs, the chunk's check when offloaded that way), and
    after >= host_end + the check of the first chunk (in index order) whose check counts (the host FIFO's last
    step). first[c] >= on[c] - before[c], before[c+1] <= before[c] + on[c] (before[0] = 0): exact at the
    optimum, which pushes `first` down and `before` up; per pair y >= first[c] + x - 1."""
    m = pm.model
    m.add(after >= bwd_dev_opt + sum(_total(t) for t in checks))
    last: LinearExpr = 0
    before: LinearExpr = 0
    for c, terms in enumerate(checks):
        terms = [(a, x) for a, x in terms if a > 0]
        if not terms:
            continue
        on = sum(x for _, x in terms)  # the chunk is offloaded (one way of offloading at a time)
        first = m.new_bool_var(f"first_checked[{c}]")
        m.add(first >= on - before)
        for a, x in terms:
            y = m.new_bool_var(f"first_checked_as[{c},{a}]")
            m.add(y >= first + x - 1)
            last = last + a * y
        nxt = m.new_bool_var(f"checked_before[{c + 1}]")
        m.add(nxt <= before + on)
        before = nxt
    m.add(after >= host_end + last)


def _add_window_sharded(
    pm: PolicyModel,
    t: cp_model.IntVar,
    compute: int,
    extra: Terms,
    h2d: Terms,
    d2h: Terms,
    comm: Terms,
    chains: list[LinearExpr],
) -> None:
    """t >= the cost model's multi-rank window: max(compute, chain, copies + (1-f) comm, comm + (1-f) copies)
    with copies = max(H2D, D2H) (H2D + D2H half duplex), the (1-f) rows scaled by 1000 (f in 1/1000), so
    t >= their ceiling, as the cost model rounds. Serial (CPU): t >= compute + copies + collectives."""
    m, inst = pm.model, pm.inst
    if not inst.copy_overlap:
        m.add(t >= compute + _total(extra) + _total(h2d) + _total(d2h) + _total(comm))
        return
    m.add(t >= compute + _total(extra))
    slow = PERMILLE - inst.collective_overlap_permille
    links = [_total(h2d), _total(d2h)] if inst.params.full_duplex else [_total(h2d) + _total(d2h)]
    M = _total(comm)
    for copies in links:
        m.add(PERMILLE * t >= PERMILLE * copies + slow * M)
        m.add(PERMILLE * t >= PERMILLE * M + slow * copies)
    for chain in chains:
        m.add(t >= chain)
    for a, x in h2d + d2h + comm:  # the convex-hull cut of _add_window, for every single term
        if a > compute:
            m.add(t >= compute + (a - compute) * x)


def _add_time_sharded(pm: PolicyModel) -> None:
    """`_add_time` for a multi-rank job: the cost model's "Multi-rank jobs" windows, row for row. Forward,
    uploads and the one-buffer rule are the single-process rows (a sharded chunk is uploaded whole); backward
    windows add the gradient reductions; step() adds the sharded chunks' all-gathers (private compute copies)
    or one barrier (node-shared ones)."""
    m, inst = pm.model, pm.inst
    C, W = inst.n_chunks, max(inst.n_chunks, 1)
    U, G, H = inst.upload_ns, inst.grad_offload_ns, inst.host_optim_ns
    FILL = inst.grad_fill_ns
    AG, RS, AR, Gs, Hs = (
        inst.gather_ns,
        inst.reduce_scatter_ns,
        inst.all_reduce_ns,
        inst.shard_grad_offload_ns,
        inst.shard_host_optim_ns,
    )
    duplex, overlap = inst.params.full_duplex, inst.copy_overlap
    assert pm.nbuf1 is not None
    F, Bk, REC, SO, SI = _window_terms(pm)
    lt = _late_use_terms(pm, U, ())
    red_max = [max(r, a) for r, a in zip(RS, AR, strict=True)]
    gout_max = [max(g, s) for g, s in zip(G, Gs, strict=True)]
    work_max = [max(h, hs + ag + f) for h, hs, ag, f in zip(H, Hs, AG, FILL, strict=True)]
    upper = (
        sum(inst.fwd_ns)
        + sum(inst.bwd_ns)
        + sum(inst.rec_ns)
        + sum(inst.swap_out_ns)
        + sum(inst.swap_in_ns)
        + sum(U) * 2
        + lt.bound
        + sum(red_max) * 2
        + sum(gout_max) * 2
        + sum(inst.device_optim_ns)
        + sum(work_max) * 2
        + inst.step_barrier_ns
        + 2 * sum(inst.device_gather_ns)
        + max(inst.control_ns, inst.phase_control_ns) * (2 + 2 * C + 3)
    )
    ok = lambda c: 0 <= c < C  # noqa: E731
    rep = [pm.off[c] - pm.osh[c] for c in range(C)]  # offloaded and replicated (0/1: sh <= off)

    def up(c: int) -> Terms:
        return [(U[c], pm.off[c])] if ok(c) else []

    def need(c: int) -> Terms:  # not in a buffer after forward, or displaced by a tied chunk: uploaded again
        return [(U[c], pm.off[c] - pm.res[c]), *_displaced(lt, U, c)] if ok(c) else []

    def red(c: int) -> Terms:  # reduce-scatter when sharded, all-reduce when replicated (persistent too)
        return [(RS[c], pm.osh[c]), (AR[c], 1 - pm.osh[c])] if ok(c) else []

    def gout(c: int) -> Terms:  # the rank's gradient shard (sharded) or the whole gradient copied out
        return [(Gs[c], pm.osh[c]), (G[c], rep[c])] if ok(c) else []

    # forward: the single-process windows
    tf = [m.new_int_var(F[c], upper, f"tf[{c}]") for c in range(W)]
    for c in range(W):
        _add_window(m, tf[c], F[c], [], up(c + 1) + lt.forward[c], SO[c], duplex, overlap)
        if overlap and c + 1 < C:
            m.add(tf[c] >= F[c] + U[c + 1] * _serial_pair(pm, c, c + 1))
        if overlap and lt.serial[c]:
            m.add(tf[c] >= F[c] + _total(lt.serial[c]))
    fwd = _total(up(0)) + sum(tf)

    # backward: the chunk that just finished is reduced, then (offloaded) its gradient copied out
    tb = [m.new_int_var(Bk[c], upper, f"tb[{c}]") for c in range(W)]
    for c in range(W):
        h2d = (need(c - 1) + SI[c - 1]) if c >= 1 else []
        chain = _total(red(c + 1)) + _total(gout(c + 1))
        _add_window_sharded(pm, tb[c], Bk[c], REC[c], h2d, gout(c + 1), red(c + 1), [chain])
        if overlap and 1 <= c < C:
            m.add(tb[c] >= Bk[c] + _total(REC[c]) + U[c - 1] * _serial_pair(pm, c - 1, c))
    head = _total(need(C - 1) + SI[W - 1])
    tail = _total(red(0))
    bwd = head + sum(tb) + tail

    # optimizer: persistent chunks step whole on the device; the host worker (FIFO) all-gathers a sharded
    # chunk's `.grad` and steps its shard, or steps the whole (replicated) chunk; at optimizer.step() the sharded
    # chunks' private compute copies are all-gathered (several nodes) or one barrier runs (node-shared copies,
    # any chunk sharded), after the steps clipping redoes (cost_model.host_queue)
    SDO = inst.shard_device_optim_ns or inst.device_optim_ns
    dev_opt = sum(
        inst.device_optim_ns[c] * (1 - pm.off[c]) - (inst.device_optim_ns[c] - SDO[c]) * pm.dsh[c]
        for c in range(C)
    )
    # device-sharded chunks: their all-gathers' exposed time (cost_model.device_gather_exposed_ns)
    dgather: LinearExpr = sum(
        device_gather_exposed_ns(inst, c) * pm.dsh[c] for c in range(C) if inst.device_gather_ns
    )
    step = [Hs[c] * pm.osh[c] + H[c] * rep[c] for c in range(C)]
    gather: LinearExpr = sum(AG[c] * pm.osh[c] for c in range(C))
    if inst.step_barrier_ns:
        any_sh = m.new_bool_var("any_sharded")
        for c in range(C):
            m.add(any_sh >= pm.osh[c])
        gather = gather + inst.step_barrier_ns * any_sh
    work = [step[c] + FILL[c] * pm.osh[c] for c in range(C)]
    redo = (sum(step) if inst.redo_host_steps else 0) + gather + _control_checks(pm)
    if not overlap:
        host_work = sum(work) + (_total(gout(0)) if C else 0)
        pm.iteration = m.new_int_var(0, upper * 2, "iteration_ns")
        m.add(pm.iteration == fwd + bwd + dev_opt + host_work + redo + dgather)
        return
    host_end = m.new_int_var(0, upper, "host_end")
    dones = _backward_done(m, head, tb, upper)
    queued: LinearExpr = 0
    for c in range(C):
        q = m.new_int_var(0, sum(work_max), f"host_queued[{c}]")
        m.add(q == queued + work[c])
        queued = q
        # an offloaded chunk's gradient is reduced (scattered when sharded, all-reduced when not), then
        # its shard or the whole of it copied out
        arrive = (RS[c] + Gs[c]) * pm.osh[c] + (AR[c] + G[c]) * rep[c]
        m.add(host_end >= dones[c] + arrive + queued)
    after = m.new_int_var(0, upper, "after_forward")
    checks = [[(inst.validate(c, sharded=True), pm.osh[c]), (inst.validate(c), rep[c])] for c in range(C)]
    _add_settled(pm, after, bwd + dev_opt, host_end, checks)
    pm.iteration = m.new_int_var(0, upper * 2, "iteration_ns")
    m.add(pm.iteration == fwd + after + redo + dgather)


def _control_checks(pm: PolicyModel) -> LinearExpr:
    """`cost_model.control_checks_ns` as rows: at a phase's end (`phase_control_ns`) one
    check when any chunk is offloaded (any_off = max off[c]), one in every plan (the agreement at backward's
    end) and 2 with device-sharded chunks (any_dsh = max dsh[c]); `control_ns` for 2 per
    device-sharded chunk and one when any_off and any_dsh; each indicator pinned both ways, so it is exact
    under every objective."""
    m, inst = pm.model, pm.inst
    ctl, C = inst.control_ns, inst.n_chunks
    if not ctl or not C:
        return 0
    pctl = inst.phase_control_ns
    any_off = m.new_bool_var("any_offloaded")
    m.add_max_equality(any_off, pm.off)
    at_phase_end: LinearExpr = any_off + 1
    if not inst.device_shard_bytes_of:
        return pctl * at_phase_end
    # pm.dsh holds expressions (sh - osh)
    any_dsh = m.new_bool_var("any_device_sharded")
    for c in range(C):
        m.add(any_dsh >= pm.dsh[c])
    m.add(any_dsh <= sum(pm.dsh))
    both = m.new_bool_var("offloaded_and_device_sharded")  # the agreement at backward's start
    m.add(both >= any_off + any_dsh - 1)
    m.add(both <= any_off)
    m.add(both <= any_dsh)
    return pctl * (at_phase_end + 2 * any_dsh) + ctl * (2 * sum(pm.dsh) + both)


def _static_device(pm: PolicyModel) -> cp_model.IntVar:
    """One variable for the model-state bytes on the device (persistent chunks + buffers), shared by all steps."""
    inst = pm.inst
    assert pm.nbuf is not None
    C = inst.n_chunks
    top = sum(inst.state_bytes(c) for c in range(C)) + C * inst.buffer_bytes
    states: LinearExpr = sum(inst.state_bytes(c) * (1 - v) for c, v in enumerate(pm.off))
    if pm.dsh and inst.device_shard_bytes_of:  # device-sharded chunks: their shards, two gathered copies
        gb = inst.device_gather_bytes_of
        top += sum(
            max(0, x - inst.state_bytes(c)) for c, x in enumerate(inst.device_shard_bytes_of)
        ) + 2 * max(gb)
        gmax = pm.model.new_int_var(0, max(gb), "gathered_max_bytes")
        for c in range(C):
            pm.model.add(gmax >= gb[c] * pm.dsh[c])
        states = states - sum(
            (inst.state_bytes(c) - inst.device_shard_bytes_of[c]) * pm.dsh[c] for c in range(C)
        )
        states = states + 2 * gmax
    static = pm.model.new_int_var(0, top, "static_device_bytes")
    pm.model.add(static == states + inst.buffer_bytes * pm.nbuf)
    return static


def _activation_walk(pm: PolicyModel) -> list[LinearExpr]:
    """Device bytes above the static ones at every forward/backward step of the walk (one expr per step)."""
    m, inst = pm.model, pm.inst
    act, inp = inst.act_bytes, inst.inp_bytes
    top = sum(max(a, i) for a, i in zip(act, inp, strict=True))
    prefix: LinearExpr = 0
    steps: list[LinearExpr] = []
    for b in range(inst.n_blocks):
        fwd_own = (act[b] + inst.fwd_peak_bytes[b]) * (pm.keep[b] + pm.swap[b]) + (
            inp[b] + inst.fwd_peak_bytes[b]
        ) * pm.ckpt[b]
        bwd_own = act[b] + inst.bwd_peak_bytes[b] + inp[b] * pm.ckpt[b]
        if b > 0:
            bwd_own = bwd_own + act[b - 1] * pm.swap[b - 1]
            if inst.copy_overlap:  # the previous swapped block's storages live through this forward
                fwd_own = fwd_own + act[b - 1] * pm.swap[b - 1]
        steps.append(prefix + fwd_own)
        steps.append(prefix + bwd_own)
        retained = act[b] * pm.keep[b] + inp[b] * pm.ckpt[b]
        p = m.new_int_var(0, top, f"prefix[{b + 1}]")
        m.add(p == prefix + retained)
        prefix = p
    return steps


def _add_device_memory(pm: PolicyModel, limit_bytes: int | None) -> None:
    """peak >= static + every walk step; with a limit, peak <= limit (the usable bytes after alpha)."""
    m, inst = pm.model, pm.inst
    static = _static_device(pm)
    top = (
        sum(inst.state_bytes(c) for c in range(inst.n_chunks))
        + inst.n_chunks * inst.buffer_bytes
        + 2 * sum(inst.act_bytes)
        + sum(inst.inp_bytes)
        + max(inst.fwd_peak_bytes + inst.bwd_peak_bytes, default=0)
    )
    pm.peak = m.new_int_var(0, top, "peak_device_bytes")
    for step in _activation_walk(pm):
        m.add(pm.peak >= static + step)
    if limit_bytes is not None:
        m.add(pm.peak <= limit_bytes)


def _add_host_memory(pm: PolicyModel) -> None:
    """Offloaded chunks' states and host extras + swapped activations fit the host limit; the pinned part
    (offloaded chunks' pinned buffers + swapped activations) fits the pinned limit (bytes; see cost_model)."""
    inst = pm.inst
    swapped = sum(inst.act_bytes[b] * pm.swap[b] for b in range(inst.n_blocks))
    if inst.sharded_job:  # one rank's bytes; the node's ranks share its host RAM, each its own pinned limit
        C = inst.n_chunks
        sh, rep = pm.osh, [pm.off[c] - pm.osh[c] for c in range(C)]
        host = (
            sum(inst.shard_host_bytes_of[c] * sh[c] + inst.host_bytes(c) * rep[c] for c in range(C)) + swapped
        )
        pm.model.add(inst.ranks_per_node * host <= inst.host_limit_bytes)
        if inst.pinned_limit_bytes is not None:
            pinned = (
                sum(inst.shard_pinned_bytes_of[c] * sh[c] + inst.pinned_bytes(c) * rep[c] for c in range(C))
                + swapped
            )
            pm.model.add(pinned <= inst.pinned_limit_bytes)
        return
    host = sum(inst.host_bytes(c) * v for c, v in enumerate(pm.off)) + swapped
    pm.model.add(host <= inst.host_limit_bytes)
    if inst.pinned_limit_bytes is not None:
        pinned = sum(inst.pinned_bytes(c) * v for c, v in enumerate(pm.off)) + swapped
        pm.model.add(pinned <= inst.pinned_limit_bytes)


def build(inst: PolicyInstance, *, objective: str = "time", cutoff_ns: int | None = None) -> PolicyModel:
    """The full model. objective 'time': min iteration ns within the usable device bytes;
    'memory': min peak device bytes (host limits still apply), used to report the smallest device that fits.
    `cutoff_ns`: only solutions strictly faster than this (prunes a layout against an incumbent)."""
    pm = PolicyModel(model=cp_model.CpModel(), inst=inst)
    _add_modes(pm)
    _add_placement(pm)
    _add_host_memory(pm)
    if objective == "time":
        _add_device_memory(pm, inst.usable_device_bytes)
        _add_time(pm)
        assert pm.iteration is not None
        if cutoff_ns is not None:
            pm.model.add(pm.iteration <= cutoff_ns - 1)
        pm.model.minimize(pm.iteration)
    elif objective == "memory":
        _add_device_memory(pm, None)
        assert pm.peak is not None
        pm.model.minimize(pm.peak)
    else:
        raise ValueError(f"objective: unknown {objective!r} (use 'time' or 'memory')")
    return pm


def _backward_done(
    m: cp_model.CpModel, head: LinearExpr, tb: list[cp_model.IntVar], upper: int
) -> list[cp_model.IntVar]:
    """done[c]: backward time through window c (windows run W-1..0, after `head`), as a chain of variables."""
    W = len(tb)
    done = m.new_int_var(0, upper, f"done[{W - 1}]")
    m.add(done == head + tb[W - 1])
    dones = [done]
    for c in range(W - 2, -1, -1):
        nxt = m.new_int_var(0, upper, f"done[{c}]")
        m.add(nxt == dones[-1] + tb[c])
        dones.append(nxt)
    dones.reverse()
    return dones
