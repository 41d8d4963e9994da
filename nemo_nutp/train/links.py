"""The slow-link watch in the training loop (issue #36 item 2; the decisions are
``health/links.py``'s, this module moves the bytes).

Agreement: rank 0 alone runs the detectors (``LinkWatch.observe`` on the reduced step metrics).
The GPUs it wants probed ride in the *next* step's metrics all-reduce (``gather_times``'
``probe`` slots: per replica GPU + 1, and the message size; MAX, every other rank writes 0), so
every rank reads the same request after the same step and runs the same probe: the same
rounds, the same p2p ops in the same order, then one all-reduce of the pair times. No extra
collective on a step without a probe; a request from the last step is dropped.

**Mitigation** (issue #36 item 3): when a probe marks a GPU slow (or finds a marked one
recovered), rank 0 prices the ladder from the cost model (``Plan.sync_seconds`` with the
measured healthy rate, the healthy step time the watch kept): do nothing; (a) the NIC-aware sync
layout (``health.slow_links``); (b) re-split micro-batches (a stage boundary only); (c) exclude
the GPU; (d) restart. It prints the rungs, logs ``link_ladder``, and takes the fastest rung this
run can apply (``health.links.choose``): under ``recovery.mode=live`` the sync re-layout goes
through the live re-layout at the next step boundary (rank 0's flag rides in the next step's
metrics all-reduce, so every rank stops at the same boundary; rank 0 posts the slow NICs; the
control process re-plans with them: ``cause: slow_link``). A recovered link restores the layout
the same way. Five steps after it, ``link_mitigation`` gives the predicted and the measured step
time. The watch (marks, kept steps, the pending measurement) moves to the next world with rank
0's process (``LinkWatch.carry``).

The probe's transfers go through ``Comm.exchange`` on the (sender, receiver) pair, so the
emulated network and a ``slow_link`` fault apply to them as to the step's own traffic; their
bytes and seconds are taken out of ``Comm``'s counters afterwards (``take_step``), so the next
step's measured rates are the step's own. A pair's message is sent in ``PROBE_REPEATS`` equal
parts, one after the other, and the pair's time is the fastest part's (noise only adds time),
the smaller of its two ends' (the end that arrived later waited less for the other).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..common.events import log_event
from ..health.links import (
    PROBE_REPEATS,
    LinkWatch,
    Mitigation,
    Pair,
    Rung,
    choose,
    probe_bytes,
    probe_pairs,
    probe_rounds,
)

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan
    from ..parallel.comm import Comm


def watched(comm: Comm) -> bool:
    """Whether a world has links to watch: under NCCL, or with the emulated network. A gloo
    world without emulation runs on one host's loopback: its "links" are the host's CPU, whose
    jitter at microsecond transfers would only make false alarms (and probes) in every run."""
    return comm.rate_mb_s is not None or dist.get_backend() == "nccl"


class LinkProbe:
    """One rank's side of the watch: rank 0 holds the ``LinkWatch``; every rank runs probes.
    ``carried``: rank 0's watch of the world before (a live re-layout); ``live``: re-layouts
    can be asked for (``recovery.mode=live``)."""

    def __init__(self, plan: Plan, comm: Comm, device: torch.device, *, rank0: bool,
                 cfg: JobConfig | None = None, live: bool = False,
                 carried: LinkWatch | None = None, start: int = 0) -> None:
        self.plan, self.comm, self.device = plan, comm, device
        self.cfg, self.live = cfg, live
        self.n = len(plan.replicas)
        replica_of = {plan.rank_to_gpu[r]: i for i, rep in enumerate(plan.replicas)
                      for ranks in rep.ranks for r in ranks}
        self.gpus = sorted(replica_of)
        self.gpu_rank = {plan.rank_to_gpu[r]: r for r in range(plan.world_size)}
        self.domain_size = comm.domains.domain_size
        self.watch: LinkWatch | None = None
        if rank0:
            self.watch = (carried.carry(replica_of, self.n) if carried is not None
                          else LinkWatch(replica_of, self.n))
            for g, ratio in plan.request.health.slow_links:  # planned around: re-probed
                if g in replica_of and g not in self.watch.marked:
                    self.watch.marked[g], self.watch.ratios[g] = start, ratio
        self.pending: list[float] = [0.0] * (self.n + 2)  # rank 0's request for the next step
        self.want: dict[int, float] | None = None  # rank 0: the slow NICs a re-layout is for
        self.due = False  # every rank: stop after this step for a link re-layout
        # rank 0: the marks the layout (or the last ladder) answered; a change is priced once
        self.decided = frozenset(g for g, _ in plan.request.health.slow_links)

    def slots(self) -> list[float]:
        """This rank's ``probe`` slots for this step's all-reduce (rank 0's pending request:
        per replica a GPU to probe + 1, the message size, the re-layout flag)."""
        out, self.pending = self.pending, [0.0] * (self.n + 2)
        return out

    def relayout_due(self) -> dict[int, float] | None:
        """After a step, on every rank: the slow NICs to re-lay out around at this boundary
        (rank 0: the set; other ranks: ``{}``), or None."""
        if not self.due:
            return None
        return dict(self.want or {})

    def after_step(self, step: int, step_s: float, rates: Sequence[dict[str, Any] | None],
                   reduced: Sequence[float], step_bytes: int) -> None:
        """Every rank after the step's all-reduce: run the probe ``reduced`` (the slots as
        reduced) asks for; then rank 0 judges this step and queues its next request."""
        self.due = reduced[self.n + 1] > 0
        suspects = sorted(int(v) - 1 for v in reduced[:self.n] if v > 0)
        if suspects:
            self.probe(step, suspects, int(reduced[self.n]))
        if self.watch is not None:
            w = self.watch
            settled = w.settle(step, step_s)
            if settled is not None:
                log_event(settled.pop("event"), **settled)
            marks = frozenset(w.ratios)
            if self.want is None and w.mitigation is None and marks != self.decided:
                # marks changed (after a probe, or once a mitigation's measurement settled)
                new, self.decided = marks - self.decided, marks
                self.mitigate(step, min((w.marked[g] for g in new), default=step))
            want = w.observe(step, step_s, rates)
            for g in want:
                r = self.watch.replica_of[g]
                if self.pending[r] == 0.0:  # one suspect per replica and probe
                    self.pending[r] = float(g + 1)
            if want:
                self.pending[self.n] = float(probe_bytes(step_bytes))

    def probe(self, step: int, suspects: list[int], nbytes: int) -> None:
        pairs = probe_pairs(suspects, self.gpus, self.domain_size)
        seconds = self.time_pairs(pairs, nbytes)
        if self.watch is None:
            return
        log_event("link_probe", suspects=suspects, pairs=[list(p) for p in pairs],
                  seconds=[round(s, 6) for s in seconds], bytes=nbytes, step=step)
        for e in self.watch.judge(step, suspects, pairs, seconds):
            log_event(e.pop("event"), **e)

    def mitigate(self, step: int, since: int) -> None:
        """Rank 0, after a probe changed the marks: price the ladder, print and log it, and
        ask for the re-layout the chosen rung needs (at the next step's boundary)."""
        assert self.watch is not None
        w, plan = self.watch, self.plan
        now = {g: round(r, 4) for g, r in sorted(w.ratios.items())}
        was = dict(plan.request.health.slow_links)
        if set(now) == set(was):
            return
        rate = self.comm.rate_mb_s or w.healthy_rate(since - 2)
        healthy = w.healthy_step_s(since - 2)  # the alarm's steps are not healthy
        last = [t for _, t, _ in w.history[-3:]]
        slowed = last[-1] if last else healthy  # the step that raised the alarm
        if now:  # found slow: priced from the healthy steps, under the layout they ran
            rungs = self.ladder(now, was, rate, slowed, ref=healthy, ref_links=was)
        else:  # recovered: from the steps just run (this layout, the link healthy again)
            ref = sorted(last)[len(last) // 2] if last else healthy
            rungs = self.ladder(now, was, rate, ref, ref=ref, ref_links=now)
        rung, why = choose(rungs, live=self.live)
        log_event("link_ladder", step=step, slow_links=now, chosen=rung.action, why=why,
                  healthy_step_s=round(healthy, 4), slowed_step_s=round(slowed, 4),
                  rungs=[{"action": r.action, "predicted_step_s": None if
                          r.predicted_step_s is None else round(r.predicted_step_s, 4),
                          "note": r.note} for r in rungs])
        _print_ladder(rungs, rung, why, step)
        if rung.action in ("sync_relayout", "restore"):
            assert rung.predicted_step_s is not None
            self.want = now
            self.pending[self.n + 1] = 1.0
            w.mitigation = Mitigation(rung.action, rung.predicted_step_s, healthy, slowed,
                                      step + 1)
        elif rung.action == "ignore":
            log_event("link_mitigation", action="none", reason=why, step=step,
                      predicted_step_s=rung.predicted_step_s, measured_step_s=round(slowed, 4))

    def ladder(self, now: dict[int, float], was: dict[int, float], rate: float | None,
               slowed: float, *, ref: float, ref_links: dict[int, float]) -> list[Rung]:
        """The rungs' predicted step seconds: compute (``ref``, a measured step time of this
        layout with the NICs at ``ref_links``, less its predicted sync) plus each layout's
        predicted sync with the NICs ``now`` (``Plan.sync_seconds`` at the healthy ``rate``);
        excluding a GPU scales compute by the planner's throughput ratio."""
        from ..config import plan_request
        from ..health.decisions import job_for
        from ..layout import build_plan

        plan, cfg = self.plan, self.cfg
        if rate is None or cfg is None:
            return [Rung("ignore", slowed, "no scale-out rate measured: nothing to price")]
        failed = frozenset(plan.request.health.failed_gpus)
        compute = max(ref - plan.sync_seconds(rate, ref_links), 0.0)
        base = build_plan(plan_request(job_for(cfg, failed, None, {})))
        rungs = [Rung("ignore", compute + plan.sync_seconds(rate, now),
                      f"measured {slowed:.3f} s")]
        if not now:  # recovered: the original layout returns
            rungs.append(Rung("restore", compute + base.sync_seconds(rate, now),
                              "the layout without slow NICs"))
            return rungs
        aware = build_plan(plan_request(job_for(cfg, failed, None, now)))
        rungs.append(Rung("sync_relayout", compute + aware.sync_seconds(rate, now),
                          "the slow NICs' units to their TP peers, over the scale-up domain"))
        rungs.append(Rung("resplit", None, "no stage boundary crosses a slow NIC (pp=1)"
                          if plan.pp == 1 else "stage-boundary rates are not priced yet",
                          applies=False))
        try:
            excl = build_plan(plan_request(job_for(cfg, failed | set(now), None, {})))
            scale = plan.predicted_throughput / max(excl.predicted_throughput, 1e-9)
            rungs.append(Rung("exclude", compute * scale + excl.sync_seconds(rate, {}),
                              f"run without GPUs {sorted(now)}: {excl_layout(excl)}",
                              applies=False))
        except ValueError as e:
            rungs.append(Rung("exclude", None, f"no plan without them: {e}", applies=False))
        rungs.append(Rung("restart", None, "only when no live rung helps", applies=False))
        return rungs

    def time_pairs(self, pairs: Sequence[Pair], nbytes: int) -> list[float]:
        """Every rank: the pairs' transfers, round by round, and their times (all ranks)."""
        me = self.plan.rank_to_gpu[self.comm.rank]
        nccl = dist.get_backend() == "nccl"
        buf = torch.zeros(max(nbytes // 4 // PROBE_REPEATS, 1), dtype=torch.float32,
                          device=self.device)
        mine = torch.full((len(pairs),), -math.inf, dtype=torch.float64)
        for rnd in probe_rounds(pairs):
            for i in rnd:
                a, b = pairs[i]
                if me not in (a, b):
                    continue
                peer = self.gpu_rank[b if me == a else a]
                best = math.inf
                for _ in range(PROBE_REPEATS):
                    t0 = time.perf_counter()
                    self.comm.exchange([("send" if me == a else "recv", buf, peer)], nccl=nccl)
                    if nccl:
                        torch.cuda.synchronize(self.device)
                    best = min(best, time.perf_counter() - t0)
                mine[i] = -best
        self.comm.take_step()  # the probe is not the next step's traffic
        reduced = mine.to(self.device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return [-v for v in reduced.tolist()]


def excl_layout(plan: Plan) -> str:
    return "+".join("TP" + "/".join(map(str, r.tp)) for r in plan.replicas)


def _print_ladder(rungs: Sequence[Rung], chosen: Rung, why: str, step: int) -> None:
    """Rank 0's console: the ladder's rungs and the one taken."""
    from rich.table import Table

    from ..common.console import make_console

    base = rungs[0].predicted_step_s or 0.0
    t = Table(title=f"slow link at step {step}: mitigation ladder (taken: {chosen.action}; "
              f"{why})")
    for col in ("rung", "predicted step s", "predicted gain", "note"):
        t.add_column(col)
    for r in rungs:
        p = r.predicted_step_s
        t.add_row(r.action, "-" if p is None else f"{p:.3f}",
                  "-" if p is None or not base else f"{1 - p / base:+.1%}", r.note)
    make_console().print(t)
