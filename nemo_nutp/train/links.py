"""The slow-link watch in the training loop (issue #36 item 2; the decisions are
``health/links.py``'s, this module moves the bytes).

Agreement: rank 0 alone runs the detectors (``LinkWatch.observe`` on the reduced step metrics).
The GPUs it wants probed ride in the *next* step's metrics all-reduce (``gather_times``'
``probe`` slots: per replica GPU + 1, and the message size; MAX, every other rank writes 0), so
every rank reads the same request after the same step and runs the same probe: the same
rounds, the same p2p ops in the same order, then one all-reduce of the pair times. No extra
collective on a step without a probe; a request from the last step is dropped.

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
    Pair,
    probe_bytes,
    probe_pairs,
    probe_rounds,
)

if TYPE_CHECKING:
    from ..layout import Plan
    from ..parallel.comm import Comm


def watched(comm: Comm) -> bool:
    """Whether a world has links to watch: under NCCL, or with the emulated network. A gloo
    world without emulation runs on one host's loopback: its "links" are the host's CPU, whose
    jitter at microsecond transfers would only make false alarms (and probes) in every run."""
    return comm.rate_mb_s is not None or dist.get_backend() == "nccl"


class LinkProbe:
    """One rank's side of the watch: rank 0 holds the ``LinkWatch``; every rank runs probes."""

    def __init__(self, plan: Plan, comm: Comm, device: torch.device, *, rank0: bool) -> None:
        self.plan, self.comm, self.device = plan, comm, device
        self.n = len(plan.replicas)
        replica_of = {plan.rank_to_gpu[r]: i for i, rep in enumerate(plan.replicas)
                      for ranks in rep.ranks for r in ranks}
        self.gpus = sorted(replica_of)
        self.gpu_rank = {plan.rank_to_gpu[r]: r for r in range(plan.world_size)}
        self.domain_size = comm.domains.domain_size
        self.watch = LinkWatch(replica_of, self.n) if rank0 else None
        self.pending: list[float] = [0.0] * (self.n + 1)  # rank 0's request for the next step

    def slots(self) -> list[float]:
        """This rank's ``probe`` slots for this step's all-reduce (rank 0's pending request)."""
        out, self.pending = self.pending, [0.0] * (self.n + 1)
        return out

    def after_step(self, step: int, step_s: float, rates: Sequence[dict[str, Any] | None],
                   reduced: Sequence[float], step_bytes: int) -> None:
        """Every rank after the step's all-reduce: run the probe ``reduced`` (the slots as
        reduced) asks for; then rank 0 judges this step and queues its next request."""
        suspects = sorted(int(v) - 1 for v in reduced[:self.n] if v > 0)
        if suspects:
            self.probe(step, suspects, int(reduced[self.n]))
        if self.watch is not None:
            want = self.watch.observe(step, step_s, rates)
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
