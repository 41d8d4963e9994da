"""The one place the training step's data path communicates: timing per process group, and
an emulated scale-out network for tests and demos (issue #36 items 1 and 4).

What goes through ``Comm``: the cross-replica gradient sync (the engine's bucket all-reduce /
reduce-scatter, the reduce-scatter norm's per-group all-reduce, the TP grad-norm all-reduce),
the distributed optimizer's parameter all-gather, the pipeline's stage-boundary and
tied-embedding p2p and its replica grad-norm all-reduce. What does not: the reshard p2p inside a
replica stage (``sync/p2p.py``: always between TP ranks of one replica, so inside one scale-up
domain), the distributed optimizer's redundancy ring (``recovery.live_redundancy``), the control
plane (the loss and per-step metric reductions, live votes, checkpoint barriers: a few bytes
each, whose time is mostly waiting for the slowest rank, which would read as a slow link) and
the live re-layout's state moves (``relayout/``), which are not a step's traffic.
megatron-core's own TP collectives, inside its layers, stay inside one scale-up domain by
construction: a replica stage's TP group never spans two domains (``build_groups`` asserts it),
so neither they nor the reshard p2p need emulation.

Contract of an op (``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``,
``exchange``): the same math as the ``torch.distributed`` call it wraps, issued at once
(``async_op=True``), on the caller's group. Its *bytes* are the size of the data it reduces,
gathers or moves (the larger buffer: NCCL's "algorithm bandwidth" bytes, not the ring's wire
traffic); a p2p op's group is the pair (this rank, peer).

Emulation (``cluster.emulated_scale_out_mb_s``, ``Comm.rate_mb_s``): an op on a group whose
members' GPUs lie in more than one scale-up domain (``Domains.crosses``) completes no earlier
than ``bytes / rate`` after this rank's emulated NIC is free, times the largest slow-link factor
of its members' GPUs at this step (``recovery.fault.kind=slow_link``). One NIC per GPU, shared
by every cross-domain group of the rank: its ops queue behind each other whatever their group,
as on a real scale-out NIC (so a sync layout that gives one GPU two groups' traffic pays for
both; per-group links would let them overlap for free). The delay is real: the returned handle's
``is_completed`` stays False and its ``wait`` blocks until the group's helper thread releases
it, after the real operation completed and the emulated time passed; compute is never delayed
(nothing sleeps on the caller's thread until it waits). Every member computes the same delay
from data all members share (bytes, group, the job's faults), so the math and the matching of
operations never change: only time does.

Measurement: per group, the summed bytes and the time the group had an op in flight, from
issue to *completion* (found by the helper thread, which blocks in the real op's ``wait``;
overlapping ops counted once), since the last ``take_step``; and the same over all of the rank's
cross-domain groups at once (``Comm.nic``: the NIC's busy time, ops of different groups in
flight together counted once), which gives the rank's scale-out rate. Cost per step: O(groups
this rank used).

Device events under NCCL: an op's interval is timed on the device, not the host. A start event
is recorded on the caller's stream right after the op is issued (the collective's stream waits
for that point before it runs) and an end event on a side stream made to wait for the op
(``work.wait()`` under that stream: the caller's stream is not ordered after it, so overlap is
untouched); both are placed on the device timeline by their elapsed time from a reference
event of the ``Comm`` (``DeviceClock``), and the helper thread polls the end event. So a
collective queued behind a long kernel is not counted as in flight while the device had not
reached it (host timing would count it). Checked by ``make gpu-check``
(``tests/gpu/test_gpu.py``); CI has no GPU.

Threads: one daemon helper per group this rank issued an op on, started lazily; it only waits
and sleeps, and ends at ``close`` (``train/loop.py``: when a world's run closes). Under NCCL a
helper cannot ``wait`` (that orders a stream, not the host): it polls the end event (or
``is_completed`` without CUDA events); the caller's ``wait`` still calls the real ``wait``
afterwards (stream order). Without an emulated
delay an NCCL handle is not held at all: the caller's ``wait`` is the real one (the host never
blocks on device completion, so overlap is as without ``Comm``); only the timing is the
helper's. That NCCL path has not run on a GPU yet.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..common.events import log_event
from ..common.faults import SLOW_LINK_EVENT

MB = 1e6


@dataclass(frozen=True)
class Domains:
    """Which scale-up domain each global rank's GPU lies in (pure: no process group).

    ``rank_to_gpu``: the plan's; ``domain_size``: ``cluster.domain_size`` (domains are
    consecutive GPU id ranges, a trailing partial one included: ``ClusterSpec.domain_bounds``)."""

    rank_to_gpu: tuple[int, ...]
    domain_size: int

    def gpu(self, rank: int) -> int:
        return self.rank_to_gpu[rank]

    def domain(self, rank: int) -> int:
        return self.rank_to_gpu[rank] // self.domain_size

    def crosses(self, ranks: Sequence[int]) -> bool:
        """Whether the ranks' GPUs span more than one scale-up domain."""
        return len({self.domain(r) for r in ranks}) > 1


def delay_s(nbytes: int, rate_mb_s: float | None, factor: float = 1.0) -> float:
    """Emulated time of one op of ``nbytes`` on a cross-domain group at ``rate_mb_s`` (None:
    no emulation), its slowest member's GPU slowed ``factor`` x."""
    if rate_mb_s is None or nbytes <= 0:
        return 0.0
    return nbytes / (rate_mb_s * MB) * factor


@dataclass(frozen=True)
class LinkFault:
    """One GPU's cross-domain traffic slowed ``factor`` x from ``step`` up to (not including)
    ``until`` (None: to the end): ``recovery.fault.kind=slow_link`` keyed by GPU, so it survives
    a live re-layout."""

    gpu: int
    step: int
    factor: float
    until: int | None = None

    def factor_at(self, gpu: int, step: int) -> float:
        if gpu == self.gpu and step >= self.step and (self.until is None or step < self.until):
            return self.factor
        return 1.0


@dataclass
class LaneStats:
    """One group's traffic since the last ``take_step``: bytes and seconds in flight."""

    cross: bool
    nbytes: int = 0
    busy_s: float = 0.0


class _Busy:
    """Bytes and in-flight time of ops completed by any number of helper threads (the union of
    their [issue, completion] intervals, taken in completion order)."""

    def __init__(self, cross: bool) -> None:
        self.lock = threading.Lock()
        self.stats = LaneStats(cross)
        self.last_done = 0.0

    def add(self, nbytes: int, issued: float, now: float) -> None:
        with self.lock:
            s = self.stats
            s.nbytes += nbytes
            if now > self.last_done:
                s.busy_s += now - max(issued, self.last_done)
                self.last_done = now

    def take(self) -> LaneStats:
        with self.lock:
            out, self.stats = self.stats, LaneStats(self.stats.cross)
        return out


class DeviceClock:
    """Device-timeline seconds of CUDA events: elapsed time from one reference event recorded
    when the clock was made (events of one device). ``begin(work)`` / ``end(...)``: the start
    and end events of an op just issued (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(torch.cuda.current_stream(device))

    def bracket(self, work: Any) -> tuple[Any, Any]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        self.side.wait_event(start)
        with torch.cuda.stream(self.side):
            work.wait()  # the side stream (not the caller's) waits for the op
            end.record(self.side)
        return start, end

    def seconds(self, ev: Any) -> float:
        return float(self.ref.elapsed_time(ev)) / 1e3


class _Handle:
    """What an op returns: ``wait`` / ``is_completed`` of the real work, held back until the
    emulated time has passed. ``events``: its (clock, start, end) under NCCL (device timing)."""

    def __init__(self, work: Any, *, nbytes: int, issued: float, release: float,
                 nccl: bool, events: tuple[Any, Any, Any] | None = None) -> None:
        self.work, self.nbytes, self.issued, self.release = work, nbytes, issued, release
        self.nccl = nccl
        self.events = events
        self.done = threading.Event()
        self.error: BaseException | None = None

    @property
    def held(self) -> bool:
        """Whether completion is held back for an emulated delay. Under NCCL without one the
        handle is the real work's (``wait`` orders the caller's stream, the host never blocks:
        timing stays the helper's business, off the critical path)."""
        return not self.nccl or self.release > self.issued

    def is_completed(self) -> bool:
        return self.done.is_set() if self.held else bool(self.work.is_completed())

    def wait(self, timeout: Any = None) -> bool:
        if self.held:
            self.done.wait()
            if self.error is not None:
                raise self.error
        if self.nccl:  # orders the caller's stream after the collective
            self.work.wait()
        return True


class _Lane:
    """One group's helper thread and its counters (written by the helper under ``lock``)."""

    def __init__(self, name: str, members: tuple[int, ...], cross: bool,
                 nic: _Busy) -> None:
        self.members, self.cross = members, cross
        self.busy = _Busy(cross)
        self.nic = nic if cross else None  # the rank's NIC: every cross-domain lane's ops
        self.q: queue.SimpleQueue[_Handle | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"nutp-comm-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            h = self.q.get()
            if h is None:  # Comm.close: the ops queued before it are done
                return
            issued = h.issued
            try:
                if h.events is not None:  # device timing: the op's interval on the device
                    clock, start, end = h.events
                    while not end.query():
                        time.sleep(1e-4)
                elif h.nccl:
                    while not h.work.is_completed():
                        time.sleep(1e-4)
                else:
                    h.work.wait()
            except BaseException as e:  # given to the waiter
                h.error = e
            now = time.perf_counter()
            if h.release > now:
                time.sleep(h.release - now)
                now = time.perf_counter()
            if h.events is not None and h.error is None and h.release <= h.issued:
                issued, now = clock.seconds(start), clock.seconds(end)
            self.busy.add(h.nbytes, issued, now)
            if self.nic is not None:
                self.nic.add(h.nbytes, issued, now)
            h.done.set()


@dataclass
class Comm:
    """This rank's data-path communication (module docstring). ``rate_mb_s``: the emulated
    scale-out rate (None: none); ``faults``: slow links by GPU; ``step``: the step now
    (``begin_step``)."""

    domains: Domains
    rank: int
    rate_mb_s: float | None = None
    faults: tuple[LinkFault, ...] = ()
    step: int = 0
    lanes: dict[Any, _Lane] = field(default_factory=dict)
    nic: _Busy = field(default_factory=lambda: _Busy(True))
    nic_free_at: float = 0.0  # when the emulated NIC is next free (caller's thread only)
    clock: DeviceClock | None = None  # NCCL: device-event timing (made at the first op)

    def begin_step(self, step: int) -> None:
        """Step ``step`` starts: the slow-link factors of its ops; a slow link of this rank's
        GPU starting here is logged (``SLOW_LINK_EVENT``, once: at its first step)."""
        self.step = step
        gpu = self.domains.gpu(self.rank)
        for f in self.faults:
            if f.gpu == gpu and f.step == step:
                log_event(SLOW_LINK_EVENT, gpu=gpu, rank=self.rank, step=step, factor=f.factor,
                          until=f.until, pid=os.getpid())

    def factor(self, members: Sequence[int]) -> float:
        """The largest slow-link factor of the members' GPUs at this step (1.0: none)."""
        if not self.faults:
            return 1.0
        return max(f.factor_at(self.domains.gpu(r), self.step)
                   for f in self.faults for r in members)

    # -- ops --------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, *, group: Any, op: Any = None,
                   async_op: bool = False) -> Any:
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group,
                               async_op=True)
        return self.track(work, group, _nbytes(t), async_op)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, *, group: Any,
                              async_op: bool = False) -> Any:
        work = dist.reduce_scatter_tensor(out, inp, group=group, async_op=True)
        return self.track(work, group, _nbytes(inp), async_op)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, *, group: Any,
                               async_op: bool = False) -> Any:
        work = dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
        return self.track(work, group, _nbytes(out), async_op)

    def exchange(self, ops: Sequence[tuple[str, torch.Tensor, int]], *, nccl: bool) -> None:
        """Post every receive and send (``(kind, tensor, global peer)``), then wait (NCCL: one
        batched launch): the pipeline's ``p2p_exchange``. Each op is timed on its pair."""
        if not ops:
            return
        if nccl:
            p2p = [dist.P2POp(dist.irecv if kind == "recv" else dist.isend, t, peer)
                   for kind, t, peer in ops]
            works = list(dist.batch_isend_irecv(p2p))
            if len(works) != len(ops):  # coalesced: timed on the first pair, all bytes once
                total = sum(_nbytes(t) for _, t, _ in ops)
                handles = [self.track(w, ("p2p", ops[0][2]), total if i == 0 else 0, True)
                           for i, w in enumerate(works)]
            else:
                handles = [self.track(w, ("p2p", peer), _nbytes(t), True)
                           for w, (_, t, peer) in zip(works, ops, strict=True)]
        else:
            ordered = sorted(ops, key=lambda o: o[0] != "recv")
            handles = [self.track(dist.irecv(t, peer) if kind == "recv"
                                   else dist.isend(t, peer), ("p2p", peer), _nbytes(t), True)
                       for kind, t, peer in ordered]
        for h in handles:
            if h is not None:
                h.wait()

    # -- timing -----------------------------------------------------------------------------
    def _lane(self, group: Any) -> _Lane:
        key = group if isinstance(group, tuple) else id(group)
        lane = self.lanes.get(key)
        if lane is None:
            if isinstance(group, tuple):  # ("p2p", peer)
                members: tuple[int, ...] = (self.rank, group[1])
                name = f"p2p{group[1]}"
            else:
                members = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
                name = "-".join(map(str, members[:4])) + ("..." if len(members) > 4 else "")
            lane = self.lanes[key] = _Lane(name, members, self.domains.crosses(members),
                                           self.nic)
        return lane

    def track(self, work: Any, group: Any, nbytes: int, async_op: bool) -> Any:
        """Time ``work`` (issued just now on ``group``; a p2p op's: ``("p2p", global peer)``)
        and hold its completion back by the emulated time; its handle (``async_op``) or, having
        waited, None."""
        if work is None:
            return None
        lane = self._lane(group)
        now = time.perf_counter()
        release = now
        if lane.cross and self.rate_mb_s is not None:
            start = max(now, self.nic_free_at)
            release = self.nic_free_at = start + delay_s(nbytes, self.rate_mb_s,
                                                         self.factor(lane.members))
        nccl = _is_nccl(group)
        events = None
        if nccl and release <= now and torch.cuda.is_available():  # device timing
            if self.clock is None:
                self.clock = DeviceClock(torch.device("cuda", torch.cuda.current_device()))
            events = (self.clock, *self.clock.bracket(work))
        h = _Handle(work, nbytes=nbytes, issued=now, release=release, nccl=nccl,
                    events=events)
        lane.q.put(h)
        if async_op:
            return h
        h.wait()
        return None

    def close(self) -> None:
        """End the helper threads once their queued ops are released (the world is over); an
        op issued later starts a new one."""
        for lane in self.lanes.values():
            lane.q.put(None)
        self.lanes.clear()

    def take_step(self) -> Traffic:
        """Every group's bytes and seconds in flight since the last call, and the NIC's (all
        cross-domain groups at once), then zeroed; call when this step's ops have completed."""
        return Traffic([lane.busy.take() for lane in self.lanes.values()], self.nic.take())


@dataclass(frozen=True)
class Traffic:
    """One rank's data-path traffic of a step: per group, and its NIC's (cross-domain ops of
    every group, overlaps counted once)."""

    lanes: list[LaneStats]
    nic: LaneStats


def scale_out_rate(traffic: Traffic) -> tuple[float | None, int]:
    """This rank's cross-domain rate (MB/s: bytes over the NIC's seconds in flight; None: no
    such traffic) and its cross-domain bytes."""
    s = traffic.nic
    if s.nbytes <= 0 or s.busy_s <= 0:
        return None, s.nbytes
    return s.nbytes / s.busy_s / MB, s.nbytes


def _is_nccl(group: Any) -> bool:
    if not dist.is_initialized():  # a work made by hand (tests)
        return False
    return dist.get_backend(None if isinstance(group, tuple) else group) == "nccl"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Direct:
    """``Comm``'s ops straight to ``torch.distributed``, untimed: for callers handed groups built
    without a plan (``NUTPGroups.comm`` None, e.g. unit tests assembling groups by hand)."""

    def all_reduce(self, t: torch.Tensor, *, group: Any, op: Any = None,
                   async_op: bool = False) -> Any:
        if op is None:
            return dist.all_reduce(t, group=group, async_op=async_op)
        return dist.all_reduce(t, op=op, group=group, async_op=async_op)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, *, group: Any,
                              async_op: bool = False) -> Any:
        return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, *, group: Any,
                               async_op: bool = False) -> Any:
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)

    def exchange(self, ops: Sequence[tuple[str, torch.Tensor, int]], *, nccl: bool) -> None:
        if not ops:
            return
        works: list[Any]
        if nccl:
            works = list(dist.batch_isend_irecv(
                [dist.P2POp(dist.irecv if kind == "recv" else dist.isend, t, peer)
                 for kind, t, peer in ops]))
        else:
            works = [dist.irecv(t, peer) if kind == "recv" else dist.isend(t, peer)
                     for kind, t, peer in sorted(ops, key=lambda o: o[0] != "recv")]
        for w in works:
            if w is not None:
                w.wait()


def ops_of(comm: Comm | None) -> Comm | Direct:
    """``comm``, or ``Direct`` where there is none."""
    return Direct() if comm is None else comm
