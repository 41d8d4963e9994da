"""The commit protocol of a live re-layout (``recovery.mode=live``): pure decisions.

States of one rank in step ``s`` (``Phase``), entered in this order:

``compute``
    forward, backward and the gradient sync (its buckets). Optimizer state and weights are those
    of step ``s - 1``.
``voting``
    the rank finished its gradient reduction (its reduced gradients, the step's global loss and
    grad norm are in hand) and entered the vote: one all-reduce over the world of a 1 from every
    rank. No optimizer state has changed.
``committed``
    the vote returned the world size on this rank: every rank finished its reduction, so step
    ``s`` is committed. The rank applies the optimizer update from data it holds (no collective
    inside the update: the grad norm and the clipping factor come from the sync), then does the
    step's bookkeeping (metrics gather, checkpoint save). A failure from here on never loses
    step ``s``.

A rank that is stopped (its world aborted, or gloo failed a collective because a peer died)
reports ``(step, phase)`` to the control process and waits.

Invariants (``decide`` checks them, ``tests/recovery`` proves them by fault injection at every
phase):

1. A rank applies the update of step ``s`` only after the vote of ``s`` returned the world size
   *somewhere*: on itself (``committed``) or, reported by a survivor, on another rank.
2. The vote of ``s`` completes on some rank only if every rank entered it, so when any survivor
   reports ``committed`` at ``s``, every survivor is at ``voting`` or ``committed`` of ``s`` or
   later, and holds what it needs to complete ``s``: the ``voting`` ones apply it during the
   re-layout (``Decision.apply``). A dead rank's updated units are taken from a replica that
   stepped (replicas are bitwise equal after every committed step).
3. When no survivor reports ``committed`` at ``s``, no survivor applied ``s`` (1.) and the step
   is discarded everywhere (a dead rank that did apply it is gone with its state).
4. After the re-layout every rank holds exactly the last committed step ``c = Decision.step``
   and the new world starts at ``c + 1``: at most the in-flight step is recomputed, no committed
   step is lost.

A boundary re-layout (grow back, a straggler excluded: ``control.grow``) stops every rank after
the optimizer update and bookkeeping of the step ``s`` their vote agreed on: every rank reports
``(s, committed)``, so ``c = s`` and nothing is applied or recomputed.

Anything else reported (a survivor that cannot reach ``c``) is a broken invariant:
``decide`` raises and the control process falls back to a restart from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan

PHASES = ("compute", "voting", "committed")
UNMOVABLE = "unmovable"
GROW = "grow"
"""Prefix of an ``abort<gen>`` value that asks for a stop at a step boundary (grow back)."""
"""Store key prefix (``unmovable<gen>``): a rank of world ``gen`` found that the state cannot move
live (``relayout.move.MoveImpossible``); the control process restarts the job with that reason."""


@dataclass(frozen=True)
class Report:
    """What a stopped rank tells the control process."""

    step: int
    phase: str  # one of PHASES

    def __post_init__(self) -> None:
        assert self.phase in PHASES, self.phase

    @property
    def holds(self) -> int:
        """The newest step this rank has applied (-1: none)."""
        return self.step if self.phase == "committed" else self.step - 1


@dataclass(frozen=True)
class Decision:
    step: int  # last committed step (-1: none); the new world starts at step + 1
    apply: tuple[int, ...]  # ranks that apply the update of ``step`` during the re-layout


def decide(reports: Mapping[int, Report]) -> Decision:
    """The last committed step and who still applies it, from every survivor's report."""
    if not reports:
        raise ValueError("no survivor reported")
    committed = max(r.holds for r in reports.values())
    apply = []
    for rank, r in sorted(reports.items()):
        if r.holds == committed:
            continue
        if r.holds == committed - 1 and r.phase == "voting" and r.step == committed:
            apply.append(rank)
            continue
        raise RuntimeError(f"commit invariant broken: rank {rank} reported {r} but step "
                           f"{committed} is committed")
    return Decision(committed, tuple(apply))


def live_blocker(job: JobConfig, failure: Any, *, survivors: int, replicas: int = 2) -> str | None:
    """Why a failure cannot be handled live (the restart path takes it, this is logged), or
    None. ``failure``: ``decisions.Failure``; ``survivors``: ranks still alive; ``replicas``:
    the running layout's."""
    if job.recovery.mode != "live":
        return "recovery.mode is restart"
    if failure.bad_input:
        return "bad input: a restart cannot help either"
    if not failure.ranks:
        return "no rank blamed for the failure"
    if job.train.distributed_optimizer and not job.recovery.live_redundancy:
        return ("train.distributed_optimizer=true: a dead rank's optimizer slices exist "
                "nowhere else (recovery.live_redundancy=true keeps a copy)")
    if job.train.distributed_optimizer and replicas < 2:
        return ("train.distributed_optimizer=true with one replica: no copy of the optimizer "
                "slices exists (recovery.live_redundancy needs two replicas)")
    if survivors == 0:
        return "no survivor"
    return None


def renumber(old_rank_to_gpu: tuple[int, ...], new_rank_to_gpu: tuple[int, ...]
             ) -> dict[int, int | None]:
    """Old rank -> new rank (None: its GPU is not used by the new plan) by GPU identity."""
    new = {g: r for r, g in enumerate(new_rank_to_gpu)}
    return {r: new.get(g) for r, g in enumerate(old_rank_to_gpu)}


def replan(old: Plan, job: JobConfig) -> Plan:
    """The planner's plan for ``job`` (its failed GPUs), with every replica stage kept on the
    GPUs it had where the planner's degrees allow (``relayout.stable_replan``: otherwise the
    replicas behind a degraded one shift and their whole state moves). The control process
    and every rank compute it alike."""
    from ..config import plan_request
    from ..layout import build_plan
    from ..relayout import stable_replan

    plan = build_plan(plan_request(job))
    return stable_replan(old, plan) or plan
