"""Pure recovery decisions: which rank failed, which GPUs are failed next, which job to run,
when to restart for GPUs that came back.

No processes, no torch: the supervisor feeds observations (exit codes, step heartbeats, what
each rank's stack watcher saw, the health report, the newest complete checkpoint) in and acts
on the answers; ``tests/health/test_decisions.py`` covers them.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import JobConfig


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
class Activity:
    """What a rank's stack watcher last saw, sampled at ``t``: whether the main thread was
    blocked on communication (``waiting``) and when its stack last changed (``changed_t``)."""

    waiting: bool
    changed_t: float
    t: float


@dataclass(frozen=True)
class Failure:
    ranks: tuple[int, ...]  # blamed ranks (empty: a failure nobody can be blamed for)
    reason: str
    bad_input: bool = False  # ranks exited 2: the job's input is wrong, a restart cannot help


LOST = -(2**15)
"""Exit codes at or below this: the process's node agent was lost (``lost_code``); never a
signal number (those are small)."""


def lost_code(node: int) -> int:
    """The exit code of a process on ``node`` whose node agent was lost (``hosts.AgentHost``)."""
    return LOST - node


def exit_words(code: int, nodes: Sequence[str] = ()) -> str:
    """One exit code in words: ``killed by signal 9 (SIGKILL)``, ``node agent n2 lost``,
    ``exit code 1``. A lost agent's code is never printed as a signal; ``nodes`` names the
    nodes by index (``hosts.AgentHost.node_names``; a node it does not name: its index)."""
    if code <= LOST:
        node = LOST - code
        return f"node agent {nodes[node] if node < len(nodes) else node} lost"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _ranks_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def exits_reason(codes: Mapping[int, int], *, ranks: bool = False,
                 nodes: Sequence[str] = ()) -> str:
    """The exits of ``codes`` (rank -> code) in words: one phrase when they all say the same
    (``killed by signal 9 (SIGKILL)``) and ``ranks`` is false, else one per kind, with its
    ranks (``rank 1: killed by signal 9 (SIGKILL); ranks 4, 5: node agent 1 lost``)."""
    by: dict[str, list[int]] = {}
    for r in sorted(codes):
        by.setdefault(exit_words(codes[r], nodes), []).append(r)
    if len(by) == 1 and not ranks:
        return next(iter(by))
    return "; ".join(f"{_ranks_words(rs)}: {why}" for why, rs in by.items())


def blame_exits(exit_codes: dict[int, int | None], nodes: Sequence[str] = ()
                ) -> Failure | None:
    """Ranks that exited abnormally. A rank killed by a signal (negative code) or lost with its
    node's agent (``lost_code``) is the cause; ranks that then failed with an error (peers lost
    their connection) are not blamed. Ranks that all exited 2 (bad input, ``train/worker.py``)
    make a ``bad_input`` failure: the job stops instead of restarting on fewer GPUs. The reason
    says each exit in words (``exits_reason``; ``nodes`` names the nodes)."""
    bad = {r: c for r, c in exit_codes.items() if c not in (None, 0)}
    if not bad:
        return None
    signalled = {r: c for r, c in bad.items() if c is not None and c < 0}
    if signalled:
        return Failure(tuple(sorted(signalled)), exits_reason(signalled, nodes=nodes))
    if all(c == 2 for c in bad.values()):  # train/worker.py: bad config, data or checkpoint
        return Failure(tuple(sorted(bad)), "exited with an input error", bad_input=True)
    return Failure(tuple(sorted(bad)), exits_reason({r: c for r, c in bad.items()
                                                     if c is not None}, nodes=nodes))


def is_comm_wait(filename: str, line: str) -> bool:
    """Whether a main thread whose innermost Python frame is at ``line`` of ``filename`` is
    blocked on communication: inside torch.distributed's collective API, or on a ``wait()`` of
    an async collective's work handle (a C call, so the caller's line is the innermost)."""
    return (filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py")
            or ".wait(" in line)


def blame_hang(progress: Mapping[int, Progress | None], *, now: float, timeout_s: float,
               started_at: float, startup_timeout_s: float,
               activity: Mapping[int, Activity | None] | None = None,
               collectives: Mapping[int, Mapping[str, int] | None] | None = None,
               ) -> Failure | None:
    """A hang: no sign of progress for ``timeout_s`` (or no heartbeat at all within
    ``startup_timeout_s`` and no rank activity for ``timeout_s``). Signs of progress are step
    heartbeats and, between steps (the newest heartbeat is a 'done': checkpoint saves and the
    end-of-run report, which may take longer than a step), the activity of any rank. Inside a
    step only heartbeats count, so a rank that spins without finishing its step is still found.

    Peers of a hung rank block in its next collective, so every rank looks stale and usually
    all report the same step. With ``collectives`` (per rank: how many collectives it entered
    on each process group) the ranks others wait for and that wait for nobody are blamed
    (``hang_roots``): this needs no timing and no guess of where a rank waits (a victim whose
    main thread waits on a helper thread blocked in a collective, or a victim blocked on another
    victim, is not a root). Else, with
    ``activity``, the ranks *not* blocked on communication (or
    whose watcher fell silent for ``timeout_s``) are blamed when some but not all are. Otherwise
    the hung rank is the one that progressed least; if all progressed equally nobody is blamed
    (restart the same layout)."""
    beats = [p for p in progress.values() if p is not None]
    acts = {r: a for r, a in (activity or {}).items() if a is not None}
    if not beats:
        # Start-up (imports, process groups, loading a checkpoint) may outlast the limit while
        # some rank is still busy: only a start-up without any activity for timeout_s fails.
        busy = max((a.changed_t for a in acts.values()), default=started_at)
        if now - started_at > startup_timeout_s and now - busy > timeout_s:
            return Failure((), f"no heartbeat within {startup_timeout_s:.0f} s of start")
        return None
    newest = max(beats, key=lambda p: p.t)
    last = max([newest.t] + [a.changed_t for a in acts.values() if newest.phase == "done"])
    if now - last <= timeout_s:
        return None
    silent = tuple(sorted(r for r, p in progress.items() if p is None))
    if silent and now - started_at > startup_timeout_s:
        return Failure(silent, "never sent a heartbeat")
    least = min(p.rank_key for p in beats)
    if collectives:
        late = hang_roots(collectives)
        if 0 < len(late) < len(progress):
            return Failure(late, f"hung: no progress for {timeout_s:.0f} s at step {least[0]}, "
                           "behind its peers in their collectives")
    if activity is not None:
        stuck = tuple(sorted(r for r in progress if r not in acts or not acts[r].waiting
                             or now - acts[r].t > timeout_s))
        if 0 < len(stuck) < len(progress):
            return Failure(stuck, f"hung: no progress for {timeout_s:.0f} s at step "
                           f"{least[0]}, peers blocked in collectives")
    behind = tuple(sorted(r for r, p in progress.items() if p is not None and p.rank_key == least))
    if len(behind) == len(progress):
        return Failure((), f"all ranks stalled for {timeout_s:.0f} s at step {least[0]}")
    return Failure(behind, f"hung: no progress for {timeout_s:.0f} s at step {least[0]}")


def _members(key: str, counts: Mapping[int, Mapping[str, int] | None]) -> list[int]:
    """A group's members: the ranks a legacy key ``"<name>:<r0>,<r1>,..."`` lists, else (a key
    that is the group's name) the ranks that report it (each rank reports every group it is a
    member of, entered or not: ``watch.CollectiveLog``)."""
    name, sep, tail = key.rpartition(":")
    if sep and name and all(m.isdigit() for m in tail.split(",") if m):
        return [int(m) for m in tail.split(",") if m]
    return [r for r, c in counts.items() if c is not None and key in c]


def waits_for(collectives: Mapping[int, Mapping[str, int] | None]) -> dict[int, set[int]]:
    """Who waits for whom, from the collectives each rank entered per process group (the
    explicit graph, O(members^2) per group: for tests and reports; ``hang_roots`` does not
    build it).

    ``collectives[r]`` maps a group key (the group's name, the same on every member; see
    ``_members``) to the number of collectives rank ``r`` entered on it; ``None`` for a rank
    that reported nothing (never judged). Members call a group's collectives in the same order,
    so a member that entered more collectives on a group than another one is in (or past, if
    asynchronous) a collective that cannot finish without that other member: it waits for it.
    A member without a count for a group entered none on it. Collectives some code path does
    not count are missed by every member alike, so they add no edge."""
    edges: dict[int, set[int]] = {r: set() for r, c in collectives.items() if c is not None}
    for counts in _group_counts(collectives).values():
        for r, n in counts.items():
            edges[r].update(m for m, k in counts.items() if k < n)
    return edges


def _group_counts(collectives: Mapping[int, Mapping[str, int] | None]
                  ) -> dict[str, dict[int, int]]:
    """Per group key, every reporting member's count (0 where it has none): O(entries)."""
    out: dict[str, dict[int, int]] = {}
    legacy: dict[str, list[int]] = {}
    for r, c in collectives.items():
        for key, n in (c or {}).items():
            out.setdefault(key, {})[r] = n
            if ":" in key and key not in legacy:
                legacy[key] = _members(key, {})
    for key, members in legacy.items():
        if members:
            g = out[key]
            for m in members:
                if m not in g and collectives.get(m) is not None:
                    g[m] = 0
            for r in [r for r in g if r not in members]:
                del g[r]
    return out


def hang_roots(collectives: Mapping[int, Mapping[str, int] | None]) -> tuple[int, ...]:
    """Ranks some rank waits for and that wait for nobody (``waits_for``): where a hang
    starts. Victims that wait for a victim (a chain through several groups) are not roots.
    Empty when no rank waits (all in one collective) or the waits form a cycle.

    O(reported entries), not O(members^2): in a group a member waits for somebody iff its
    count is above the group's minimum, and is waited for iff its count is below the
    maximum (the job-level aggregator runs this over every rank of a 32K-rank job)."""
    waited: set[int] = set()
    waiting: set[int] = set()
    for counts in _group_counts(collectives).values():
        lo, hi = min(counts.values()), max(counts.values())
        if lo == hi:
            continue
        for r, n in counts.items():
            if n > lo:
                waiting.add(r)
            if n < hi:
                waited.add(r)
    return tuple(sorted(waited - waiting))


def next_failed(current: frozenset[int], blamed_gpus: tuple[int, ...],
                reported: frozenset[int] | None) -> frozenset[int]:
    """Failed GPUs for the next attempt: the health report (if any) is the truth for GPUs
    known before (a GPU it no longer lists is back), plus the GPUs blamed now."""
    base = current if reported is None else reported
    return frozenset(base) | frozenset(blamed_gpus)


def lost_steps(last_done: int | None, resume_step: int) -> int:
    """Completed steps that the restart recomputes (last completed index + 1 - resume)."""
    return 0 if last_done is None else max(0, last_done + 1 - resume_step)


def job_for(cfg: JobConfig, failed: frozenset[int], slow: Mapping[int, float] | None = None,
            links: Mapping[int, float] | None = None,
            reserved: Iterable[int] | None = None) -> JobConfig:
    """The job config for a set of failed GPUs and stragglers (``slow``: GPU -> relative speed,
    found while running; added to the configured ones) and slow NICs (``links``: GPU ->
    relative scale-out rate found while running, replacing the configured ones; None: the
    configured ones), and the GPUs held back as spares (``reserved``; None: as configured). The
    policy re-plans degrees from health.

    Explicit ``nutp.replicas`` cannot describe a new failure, so it is dropped once the health
    differs from the configured one (the health report's entries are carried over)."""
    health = cfg.health.as_report()
    speeds = {**dict(health.slow_gpus), **dict(slow or {})}
    nics = dict(health.slow_links) if links is None else {int(g): float(v)
                                                          for g, v in links.items()}
    held = cfg.health.reserved_gpus if reserved is None else sorted(set(reserved))
    if (failed == frozenset(health.failed_gpus) and speeds == dict(health.slow_gpus)
            and nics == dict(health.slow_links) and held == cfg.health.reserved_gpus):
        return cfg
    now = dataclasses.replace(cfg.health, failed_gpus=sorted(failed), slow_gpus=speeds or None,
                              slow_links=nics or None, reserved_gpus=held, report=None)
    if failed == frozenset(health.failed_gpus) and speeds == dict(health.slow_gpus):
        return dataclasses.replace(cfg, health=now)  # the sync layout alone changes
    nutp = dataclasses.replace(cfg.nutp, replicas=None)
    return dataclasses.replace(cfg, health=now, nutp=nutp)


def straggler_relayout(events: list[dict[str, Any]], since: float) -> dict[int, float] | None:
    """Stragglers a world that ended normally asked to be re-planned around (rank 0's
    ``relayout_requested`` event after ``since``, ``nutp.exclude_stragglers``), or None."""
    asks = [e for e in events if e["event"] == "relayout_requested" and e["t"] >= since]
    if not asks:
        return None
    return {int(g): float(v) for g, v in asks[-1]["slow_gpus"].items()}


def returned_gpus(current: frozenset[int], reported: frozenset[int] | None) -> frozenset[int]:
    """GPUs the health report says are back while a world runs: those of ``current`` it no
    longer lists, if it lists a strict subset of ``current`` (a report that also adds GPUs is
    acted on at the next restart, not by a planned one)."""
    if reported is None or not reported < current:
        return frozenset()
    return current - reported


def scale_up_blocker(cfg: JobConfig) -> str | None:
    """Why the job cannot restart for returned GPUs without losing steps (None: it can)."""
    if cfg.checkpoint_dir is None or not cfg.checkpoint.saves:
        return "checkpointing is off"
    if cfg.checkpoint.resume == "never":
        return "checkpoint.resume is false"
    return None


def scale_up_due(*, base_step: int | None, latest_step: int | None, total_steps: int) -> bool:
    """Restart for returned GPUs now: a checkpoint newer than the newest complete one when the
    GPUs were reported back (``base_step``) is complete at ``latest_step``, and training is not
    over there (a final checkpoint leaves nothing to run at the fuller layout)."""
    if latest_step is None or (base_step is not None and latest_step <= base_step):
        return False
    return latest_step < total_steps
