"""Pure recovery decisions: which rank failed, which GPUs are failed next, which job to run.

No processes, no torch: the supervisor feeds observations (exit codes, heartbeats, the health
report) in and acts on the answers; ``tests/checkpoint/test_recovery_logic.py`` covers them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """A rank's last heartbeat: ``phase`` 'start' or 'done' of ``step`` at time ``t``."""

    phase: str
    step: int
    t: float

    @property
    def rank_key(self) -> tuple[int, int]:
        return (self.step, 1 if self.phase == "done" else 0)


@dataclass(frozen=True)
class Failure:
    ranks: tuple[int, ...]  # blamed ranks (empty: a failure nobody can be blamed for)
    reason: str


def blame_exits(exit_codes: dict[int, int | None]) -> Failure | None:
    """Ranks that exited abnormally. A rank killed by a signal (negative code) is the cause;
    ranks that then failed with an error (peers lost their connection) are not blamed."""
    bad = {r: c for r, c in exit_codes.items() if c not in (None, 0)}
    if not bad:
        return None
    signalled = tuple(sorted(r for r, c in bad.items() if c is not None and c < 0))
    if signalled:
        return Failure(signalled, "killed by signal " + ",".join(
            str(-(bad[r] or 0)) for r in signalled))
    return Failure(tuple(sorted(bad)), "exited with error")


def blame_hang(progress: dict[int, Progress | None], *, now: float, timeout_s: float,
               started_at: float, startup_timeout_s: float) -> Failure | None:
    """A hang: no heartbeat for ``timeout_s`` (or none at all within ``startup_timeout_s``).

    Peers of a hung rank block in its next collective, so every rank looks stale; the hung one
    is the rank that progressed least. If all progressed equally nobody is blamed (restart the
    same layout)."""
    beats = [p for p in progress.values() if p is not None]
    if not beats:
        if now - started_at > startup_timeout_s:
            return Failure((), f"no heartbeat within {startup_timeout_s:.0f} s of start")
        return None
    if now - max(p.t for p in beats) <= timeout_s:
        return None
    silent = tuple(sorted(r for r, p in progress.items() if p is None))
    if silent and now - started_at > startup_timeout_s:
        return Failure(silent, "never sent a heartbeat")
    least = min(p.rank_key for p in beats)
    behind = tuple(sorted(r for r, p in progress.items() if p is not None and p.rank_key == least))
    if len(behind) == len(progress):
        return Failure((), f"all ranks stalled for {timeout_s:.0f} s at step {least[0]}")
    return Failure(behind, f"no progress for {timeout_s:.0f} s at step {least[0]}")


def next_failed(current: frozenset[int], blamed_gpus: tuple[int, ...],
                reported: frozenset[int] | None) -> frozenset[int]:
    """Failed GPUs for the next attempt: the health report (if any) is the truth for GPUs
    known before (a GPU it no longer lists is back), plus the GPUs blamed now."""
    base = current if reported is None else reported
    return frozenset(base) | frozenset(blamed_gpus)


def lost_steps(last_done: int | None, resume_step: int) -> int:
    """Completed steps that the restart recomputes (last completed index + 1 - resume)."""
    return 0 if last_done is None else max(0, last_done + 1 - resume_step)


def job_for(cfg: Any, failed: frozenset[int]) -> Any:
    """The job config for a set of failed GPUs (the policy re-plans degrees from health).

    Explicit ``nutp.replicas`` cannot describe a new failure, so it is dropped once the failed
    set differs from the configured one."""
    configured = frozenset(cfg.failures.health().failed_gpus)
    if failed == configured:
        return cfg
    failures = dataclasses.replace(cfg.failures, failed_gpus=sorted(failed), report=None)
    nutp = dataclasses.replace(cfg.nutp, replicas=None)
    return dataclasses.replace(cfg, failures=failures, nutp=nutp)
