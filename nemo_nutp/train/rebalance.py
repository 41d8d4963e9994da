"""Live micro-batch rebalancing between steps (``nutp.rebalance=true``).

Contract:
* Every rank takes the same decision from the same input: the per-replica compute seconds of the
  step that the loop already all-gathers (identical lists on every rank), so no extra collective
  is needed and ranks cannot disagree on the shares.
* Shares stay positive integers summing to the global batch ``M``; a replica's weight is
  ``share / M`` (the planner's formula, so the same bits as a static plan with those shares) and
  it processes global micro-batches ``offset .. offset + share - 1`` of the step. The global
  batch of a step is therefore the same set of micro-batches whatever the shares, and the
  gradient is that of the single-process step (``sync/engine.py`` scales by the weight).
* No process group, model or optimizer is rebuilt: only this rank's ``RankContext``
  (``microbatches``, ``microbatch_offset``, ``weight``) changes, in ``groups.ctx`` (data slicing
  and loss reduction) and in the sync engine's ``ctx`` (gradient weight), between steps.
* The plan (``session.plan``) keeps the planned shares: checkpoints record the plan, and a
  resumed run starts from it and re-learns.

The controller (``ShareController``) smooths the measured seconds per micro-batch of each
replica (exponential moving average), proposes moving at most ``max_shift`` micro-batches from
the replica predicted slowest to the one predicted fastest after taking one more, and applies the
proposal only when the predicted step compute time drops by at least ``hysteresis`` (relative).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.env import EVENTS
from ..common.events import log_event

if TYPE_CHECKING:
    from ..config import JobConfig
    from .session import RankSession


@dataclasses.dataclass
class ShareController:
    """Pure decision logic (no torch): measured compute seconds -> new shares or None."""

    shares: list[int]
    smoothing: float = 0.5  # weight of the newest measurement in the moving average
    hysteresis: float = 0.05  # minimal predicted relative gain of a change
    max_shift: int = 2  # micro-batches moved per step at most
    warmup: int = 1  # first observed steps ignored (start-up costs)
    per_mb: list[float] | None = None  # smoothed seconds per micro-batch, per replica
    seen: int = 0

    def __post_init__(self) -> None:
        if not self.shares or min(self.shares) < 1:
            raise ValueError(f"shares={self.shares}: need >= 1 micro-batch per replica")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"nutp.rebalance_smoothing={self.smoothing}: must be in (0, 1]")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"nutp.rebalance_hysteresis={self.hysteresis}: must be in [0, 1)")
        if self.max_shift < 1:
            raise ValueError(f"nutp.rebalance_max_shift={self.max_shift}: must be >= 1")

    def observe(self, compute_s: Sequence[float]) -> list[int] | None:
        """Feed one step's per-replica compute seconds (taken with the current shares);
        return the new shares when they change, else None."""
        if len(compute_s) != len(self.shares):
            raise ValueError(f"compute_s has {len(compute_s)} replicas, shares "
                             f"{len(self.shares)}")
        self.seen += 1
        if self.seen <= self.warmup:
            return None
        now = [max(c, 1e-9) / m for c, m in zip(compute_s, self.shares, strict=True)]
        a = self.smoothing
        self.per_mb = now if self.per_mb is None else [
            a * x + (1.0 - a) * y for x, y in zip(now, self.per_mb, strict=True)]
        proposal = propose(self.shares, self.per_mb, self.max_shift)
        before = makespan(self.shares, self.per_mb)
        if proposal == self.shares or makespan(proposal, self.per_mb) > \
                (1.0 - self.hysteresis) * before:
            return None
        self.shares = proposal
        return list(proposal)


def makespan(shares: Sequence[int], per_mb: Sequence[float]) -> float:
    """Predicted compute seconds of the step: the slowest replica."""
    return max(s * t for s, t in zip(shares, per_mb, strict=True))


def propose(shares: Sequence[int], per_mb: Sequence[float], max_shift: int) -> list[int]:
    """Move up to ``max_shift`` micro-batches, one at a time, from the replica predicted
    slowest to the one predicted fastest with one more, while that lowers the slowest time."""
    out = list(shares)
    for _ in range(max_shift):
        i = max(range(len(out)), key=lambda r: (out[r] * per_mb[r], -r))
        j = min(range(len(out)), key=lambda r: ((out[r] + 1) * per_mb[r], r))
        if i == j or out[i] <= 1 or (out[j] + 1) * per_mb[j] >= out[i] * per_mb[i]:
            break
        out[i] -= 1
        out[j] += 1
    return out


def apply_shares(session: RankSession, shares: Sequence[int]) -> None:
    """Give this rank's replica its share of the next steps' global batch (between steps).

    Changes ``session.groups.ctx`` and the sync engine's ``ctx`` (which it reads once per step
    for the gradient weight); raises ``ValueError`` for shares that do not partition the batch."""
    m = session.plan.request.global_batch
    n = len(session.plan.replicas)
    if len(shares) != n or sum(shares) != m or min(shares) < 1:
        raise ValueError(f"shares={list(shares)}: need {n} positive shares summing to "
                         f"the global batch {m}")
    ctx = session.groups.ctx
    i = ctx.replica
    new = dataclasses.replace(ctx, microbatches=int(shares[i]),
                              microbatch_offset=int(sum(shares[:i])),
                              weight=float(shares[i]) / m)
    session.groups.ctx = new
    session.model.nutp_engine.ctx = new
    if getattr(session.gpt, "bf16_loss_grad", None) is not None:  # fused cross entropy
        session.gpt.bf16_loss_grad = new.weight


class LiveBalance:
    """What the training loop calls around each step: the injected slowdown of this rank
    (``common/faults.py`` kind slow), with ``nutp.rebalance`` the share updates, with
    ``nutp.straggler_probe_interval`` the straggler detector (``train/stragglers.py``)."""

    def __init__(self, cfg: JobConfig, session: RankSession, *, fault: Any = None,
                 rank: int = 0) -> None:
        self.session, self.fault, self.rank = session, fault, rank
        self.shares = [r.microbatches for r in session.plan.replicas]
        n = cfg.nutp
        self.controller = ShareController(
            list(self.shares), smoothing=n.rebalance_smoothing,
            hysteresis=n.rebalance_hysteresis, max_shift=n.rebalance_max_shift,
            warmup=n.rebalance_warmup) if n.rebalance else None
        self.events = os.environ.get(EVENTS) or str(Path(cfg.output.dir) / "events.jsonl")
        self.detector = None
        if n.straggler_probe_interval > 0:
            from .stragglers import StragglerDetector

            self.detector = StragglerDetector(cfg, session.plan, rank=rank, events=self.events,
                                              device=next(session.model.parameters()).device)

    def before_step(self, step: int) -> None:
        if self.fault is None:
            return
        f = self.fault.slow_factor(self.rank, step)
        if f != self.session.opts.slow_factor:
            self.session.opts = dataclasses.replace(self.session.opts, slow_factor=f)

    def after_step(self, step: int, reps: Sequence[Sequence[float]]) -> list[int]:
        """``reps``: per replica (degree, compute_s, sync_s, optimizer_s) of this step, the same
        on every rank. Returns the shares this step ran with; may change the next step's."""
        used = list(self.shares)
        if self.detector is not None:
            self.detector.after_step(step, self.session.opts.slow_factor)
        if self.controller is None:
            return used
        new = self.controller.observe([float(r[1]) for r in reps])
        if new is not None:
            apply_shares(self.session, new)
            self.shares = new
            if self.rank == 0:
                log_event("rebalance", file=self.events, step=step + 1, shares=new,
                          previous=used, per_microbatch_s=self.controller.per_mb)
        return used

    def inside_speeds(self) -> list[float] | None:
        """Per replica, its slowest rank's speed relative to its TP peers at the latest
        straggler probe (1.0: no straggler found); None without the detector. The goodput
        ledger charges ``1 - speed`` of the replica's compute to "straggler inside a replica"."""
        if self.detector is None:
            return None
        sp = self.detector.speed
        return [min(sp[r] for stage in rep.ranks for r in stage)
                for rep in self.session.plan.replicas]

    def exclusion(self) -> dict[int, float] | None:
        """``nutp.exclude_stragglers`` and a straggler found (the same on every rank: the
        probe times are all-gathered): its GPU -> relative speed; None otherwise. The live path
        (``recovery.mode=live``) re-lays out around it at this step boundary."""
        d = self.detector
        if d is None or not d.stop_pending:
            return None
        return {int(d.plan.rank_to_gpu[r]): float(v) for r, v in d.found.items()}

    def should_stop(self, step: int) -> bool:
        """True after the checkpoint save that follows a detected straggler, with
        ``nutp.exclude_stragglers`` (the relaunch re-plans without it)."""
        return self.detector is not None and self.detector.should_stop(step)
