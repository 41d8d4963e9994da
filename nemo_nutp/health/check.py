"""The one failure check of a running world, polled by the CPU supervisor's restart path
(``recovery/supervisor.py``) and by the live control loop (``recovery/control.py``) alike, in
this order:

1. **exits**: every rank exited 0 -> the world is done;
2. **blame**: a rank exited abnormally -> ``decisions.blame_exits`` (cause ``"exit"``);
3. **hang**: at most every ``HANG_POLL_S``, the caller's hang source (``hang_in``: the ranks'
   heartbeat and stack watcher files; or a host's aggregator over node digests) -> cause
   ``"hang"``;
4. **health**: the caller's health poll (``watch.HealthWatch.poll``: GPUs reported back, a
   planned restart), only when nothing above failed.

Launchers' post-mortem (``train/elastic.py``: ``blame_previous`` over the exit records of the
previous attempt) is not this check: it judges an attempt that already ended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import watch
from .decisions import Failure, blame_exits, blame_hang

if TYPE_CHECKING:
    from ..config.schema import RecoveryConfig

HANG_POLL_S = 0.5  # heartbeats and stack watcher reports (or a host's node digests)


@dataclass(frozen=True)
class Verdict:
    """What one poll of a running world found (at most one of these)."""

    done: bool = False  # every rank exited 0
    failure: Failure | None = None
    cause: str | None = None  # "exit" or "hang", with a failure
    scale_up: watch.ScaleUp | None = None  # GPUs reported back: a planned restart is due


def hang_in(hb: Path, world: int, *, now: float, started: float, rec: RecoveryConfig
            ) -> Failure | None:
    """``blame_hang`` over the ``world`` ranks' files in the heartbeat directory ``hb``: step
    heartbeats, the stack watchers' activity and collective counts (a live re-layout's later
    worlds too: each rank's watcher follows it there, ``watch.follow_world``)."""
    return blame_hang(watch.read_progress(hb, world), now=now, timeout_s=rec.heartbeat_timeout_s,
                      started_at=started, startup_timeout_s=rec.startup_timeout_s,
                      activity=watch.read_activity(hb, world),
                      collectives=watch.read_collectives(hb, world))


class FailureCheck:
    """The module docstring's check over one job's worlds; it keeps the hang polling period
    (the first hang check is due at ``started``)."""

    def __init__(self, started: float) -> None:
        self.next_hang = started

    def poll(self, codes: dict[int, int | None], *, now: float,
             hang: Callable[[float], Failure | None],
             health: Callable[[float], watch.ScaleUp | None] | None = None,
             nodes: Sequence[str] = ()) -> Verdict:
        """``codes``: each rank's exit code (None: running). ``hang(now)`` is called only when
        a hang check is due, ``health(now)`` only when no rank failed. ``nodes``: the host's
        node names (a lost node's agent is named by them)."""
        if all(c == 0 for c in codes.values()):
            return Verdict(done=True)
        failure = blame_exits(codes, nodes)
        if failure is not None:
            return Verdict(failure=failure, cause="exit")
        if now >= self.next_hang:
            self.next_hang = now + HANG_POLL_S
            failure = hang(now)
            if failure is not None:
                return Verdict(failure=failure, cause="hang")
        return Verdict(scale_up=None if health is None else health(now))
