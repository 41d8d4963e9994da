"""What recovery watches, shared by the CPU supervisor (``supervisor.py``) and the workers under
an external launcher (``elastic.py``): step heartbeats and stack watcher reports of the ranks
(``<output.dir>/recovery/heartbeats.<attempt>/rank<r>[.stack]``), the health report, the newest
complete checkpoint, and the per-restart summary of ``events.jsonl``.
"""

from __future__ import annotations

import collections
import json
import linecache
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.events import log_event
from ..common.faults import FATAL_EVENT
from ..layout.serialize import write_json_atomic
from .decisions import (
    Activity,
    Progress,
    is_comm_wait,
    job_for,
    returned_gpus,
    scale_up_blocker,
    scale_up_due,
)

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan

SAMPLE_S = 0.5  # rank side: stack watcher period
HEALTH_POLL_S = 1.0  # the health report, for GPUs reported back
CPU_EPS_S = 0.002  # CPU use between two samples that counts as activity


COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "broadcast", "reduce", "barrier", "all_to_all",
           "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather",
           "scatter", "gather_object", "scatter_object_list", "monitored_barrier",
           "_all_gather_base", "_reduce_scatter_base")
"""``torch.distributed`` collectives a rank counts (point-to-point ops are not collectives of
a group: a pair's sequence would need its own key)."""


class CollectiveLog:
    """Rank side: how many collectives this rank entered per process group, and whether its
    main thread is inside one now (``depth``). Installed by wrapping ``torch.distributed``'s
    collectives; every member of a group runs the same code, so calls made through references
    taken before the wrapping are missed on every member alike (see
    ``decisions.waits_for``).

    Groups are keyed by name (``pg.group_name``: the same on every member, O(1) per key, not
    the member list) and ``counts()`` reports every group this rank is a member of, 0 where it
    entered none, so the aggregator knows a group's members from who reports it.

    Device progress (issue #22 finding 8): under NCCL a collective call returns at once, so
    host counts are equal on every rank of a GPU-side hang. With ``event`` (a factory of
    objects with ``record()`` and ``query()``: ``torch.cuda.Event`` on CUDA, a stand-in in
    tests) an event is recorded on the current stream *before* each collective; ``counts()``
    then reports per group how many collectives the *device* reached (the event completed:
    all work before the collective is done), polled by the stack watcher thread. A rank whose
    GPU stalls stays behind its peers in those counts, which ``decisions.hang_roots`` blames.
    """

    def __init__(self, event: Any = None) -> None:
        self.entered: dict[str, int] = {}
        self.depth = 0
        self._event = event
        self._pending: dict[str, collections.deque[Any]] = {}
        self.reached: dict[str, int] = {}
        self._mine: dict[str, int] = {}
        self._seen_groups = -1

    def key(self, group: Any) -> str:
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        name = getattr(pg, "group_name", None)
        if not name:
            raise ValueError("a process group without a name")
        return str(name)

    def reset(self) -> None:
        """Count from zero (a new world: ``follow_world``); the depth stays (a wait still in
        progress is one)."""
        self.entered, self._pending, self.reached = {}, {}, {}
        self._mine, self._seen_groups = {}, -1

    def _enter(self, k: str) -> None:
        self.entered[k] = self.entered.get(k, 0) + 1
        if self._event is not None:
            self.reached.setdefault(k, 0)
            ev = self._event()
            ev.record()
            self._pending.setdefault(k, collections.deque()).append(ev)

    def poll_device(self) -> None:
        """Advance ``reached`` over the events the device completed (in order per group)."""
        for k, q in list(self._pending.items()):
            while q and q[0].query():
                q.popleft()
                self.reached[k] = self.reached.get(k, 0) + 1

    def _member_groups(self) -> dict[str, int]:
        """Every group this rank is a member of (count 0), refreshed when groups are added."""
        try:
            from torch.distributed import distributed_c10d as c10d

            world = c10d._world
            if len(world.pg_names) != self._seen_groups:
                me = c10d.get_rank()
                self._mine = {str(n): 0 for pg, n in list(world.pg_names.items())
                              if me in world.pg_group_ranks.get(pg, {})}
                self._seen_groups = len(world.pg_names)
        except Exception:  # no process group (yet): entered groups only
            pass
        return self._mine

    def counts(self) -> dict[str, int]:
        """Per group name: collectives the device reached (with events), else entered."""
        if self._event is not None:
            self.poll_device()
            done = dict(self.reached)
        else:
            done = dict(self.entered)
        return {**self._member_groups(), **done}

    def wrap(self, fn: Any) -> Any:
        import functools
        import inspect

        try:
            pos = list(inspect.signature(fn).parameters).index("group")
        except (ValueError, TypeError):
            pos = None

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[pos] if pos is not None and pos < len(args)
                               else None)
            try:
                k = self.key(group)
            except Exception:  # not a group this rank can name (not a member): leave it
                return fn(*args, **kwargs)
            self._enter(k)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        counted.__wrapped_by_nutp__ = True  # type: ignore[attr-defined]
        return counted

    def install(self) -> None:
        import torch.distributed as dist

        for name in COUNTED:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "__wrapped_by_nutp__", False):
                setattr(dist, name, self.wrap(fn))


def device_event() -> Any:
    """The factory of device-progress events for this process: ``torch.cuda.Event`` when CUDA
    is available (timing off: a cheap marker), else None (host counts are device counts)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return lambda: torch.cuda.Event(enable_timing=False)


@dataclass
class _Watcher:
    """This process's stack watcher: the file it writes now and its collective counts."""

    path: Path
    log: CollectiveLog


_WATCHER: _Watcher | None = None


def start_stack_watcher(path: Path) -> threading.Thread:
    """Start this rank's stack watcher (a daemon thread writing ``path``; see ``watch_stack``)
    and count its collectives (``CollectiveLog``)."""
    global _WATCHER
    log = CollectiveLog(event=device_event())
    log.install()
    _WATCHER = _Watcher(path, log)
    t = threading.Thread(target=watch_stack, name="nutp-stack-watch", daemon=True,
                         args=(path, threading.main_thread(), log, _WATCHER))
    t.start()
    return t


def follow_world(path: Path) -> None:
    """A live re-layout's next world (``live/manager.py``): the stack watcher writes ``path``
    from now on (the new world's heartbeat directory, the rank's new number: where the hang
    check of that world reads it) and counts the new world's collectives from zero (the old
    world's groups are gone; their counts, uneven where the failure interrupted them, would
    blame the wrong rank). A process without a watcher (a returning GPU's) starts one."""
    w = _WATCHER
    if w is None:
        start_stack_watcher(path)
        return
    w.log.reset()
    w.path = path


def read_progress(hb_dir: Path, world: int) -> dict[int, Progress | None]:
    out: dict[int, Progress | None] = {}
    for r in range(world):
        try:
            phase, step, t = (hb_dir / f"rank{r}").read_text().split()
            out[r] = Progress(phase, int(step), float(t))
        except (OSError, ValueError):
            out[r] = None
    return out


def read_activity(hb_dir: Path, world: int) -> dict[int, Activity | None]:
    out: dict[int, Activity | None] = {}
    for r in range(world):
        try:
            waiting, changed, t = (hb_dir / f"rank{r}.stack").read_text().split("\n")[0].split()
            out[r] = Activity(waiting == "1", float(changed), float(t))
        except (OSError, ValueError):
            out[r] = None
    return out


def read_collectives(hb_dir: Path, world: int) -> dict[int, dict[str, int] | None]:
    """Per rank, collectives entered per group, as its stack watcher last wrote them."""
    out: dict[int, dict[str, int] | None] = {}
    for r in range(world):
        try:
            out[r] = json.loads((hb_dir / f"rank{r}.stack").read_text().split("\n")[2])
        except (OSError, ValueError, IndexError):
            out[r] = None
    return out


def cpu_s(main_clock: int) -> float:
    """CPU seconds of the rank's main thread plus its live child processes (helpers such as
    checkpoint writers the main thread waits for); the rank's other threads are left out."""
    total = time.clock_gettime(main_clock)
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no procfs: the main thread only
        return total
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks:
        try:
            kids = Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            continue
        for pid in kids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def watch_stack(path: Path, main: threading.Thread, log: CollectiveLog | None = None,
                follow: _Watcher | None = None) -> None:
    """Rank side, a daemon thread: every ``SAMPLE_S`` write ``waiting changed_t t``, the
    innermost frame of the main thread and (JSON) the collectives entered per group: is it
    blocked on communication, when did it last show activity (its stack changed, or, outside
    communication, it or its child processes used CPU), now. Works while the main thread is
    blocked in C: collectives and sleeps release the GIL. ``follow``: the file moves with
    ``follow.path`` (``follow_world``)."""
    clock = time.pthread_getcpuclockid(main.ident or 0)
    last: tuple[tuple[str, int], ...] = ()
    changed, cpu = time.time(), cpu_s(clock)
    while True:
        if follow is not None:
            path = follow.path
        tmp = path.with_name(path.name + ".tmp")
        frame = sys._current_frames().get(main.ident or -1)
        stack = []
        f = frame
        while f is not None:
            # f_lineno is None while a frame runs no line (e.g. between instructions)
            stack.append((f.f_code.co_filename, f.f_lineno or 0, f.f_code.co_name))
            f = f.f_back
        del frame, f
        # a wait on a threading primitive (``parallel/comm.py``'s handles block on an Event
        # until the helper thread releases them) is judged by the line that waits
        while len(stack) > 1 and stack[0][0] == threading.__file__:
            stack.pop(0)
        now, used = time.time(), cpu_s(clock)
        waiting = (log is not None and log.depth > 0) or (
            bool(stack) and is_comm_wait(stack[0][0], linecache.getline(*stack[0][:2])))
        counts = json.dumps(log.counts() if log is not None else {})
        # CPU used while waiting for peers (a Work.wait() polls) is not progress
        if tuple(s[:2] for s in stack) != last or (not waiting and used - cpu > CPU_EPS_S):
            last, changed = tuple(s[:2] for s in stack), now
        cpu = used
        where = f"{stack[0][0]}:{stack[0][1]} in {stack[0][2]}" if stack else "-"
        try:
            tmp.write_text(f"{int(waiting)} {changed} {now}\n{where}\n{counts}\n")
            os.replace(tmp, path)
        except OSError:
            pass
        time.sleep(SAMPLE_S)


def read_where(hb_dir: Path, rank: int) -> str:
    """Innermost frame of ``rank``'s main thread as its stack watcher last saw it."""
    try:
        return (hb_dir / f"rank{rank}.stack").read_text().split("\n")[1]
    except (OSError, IndexError):
        return "?"


def latest_step(root: str | None) -> int | None:
    """Step of the newest complete checkpoint (the tracker's, checked on disk)."""
    from ..checkpoint.store import latest_step as tracked

    return tracked(root)


def last_done(hb: Path, world: int) -> int | None:
    beats = [p for p in read_progress(hb, world).values() if p is not None]
    done = [p.step if p.phase == "done" else p.step - 1 for p in beats]
    return max(done) if done else None


CARRIED = ("health.json", "nodes.json")
"""What a run Slurm requeued keeps of the run before it (``archive_previous_run``)."""


def read_health(path: Path) -> frozenset[int] | None:
    try:
        return frozenset(json.loads(path.read_text())["failed_gpus"])
    except (OSError, ValueError, KeyError):
        return None


def write_health(path: Path, failed: frozenset[int]) -> None:
    write_json_atomic({"failed_gpus": sorted(failed)}, path)


def summary(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per restart: detection (fault -> detected; GPU back: report seen -> restart decided),
    restart (detected -> resumed: stopping the world included), lost steps, new layout."""
    out: list[dict[str, Any]] = []
    fault_t = None
    for e in events:
        if e["event"] == FATAL_EVENT:  # a slowdown's SLOW_EVENT starts no timer
            fault_t = e["t"]
        elif e["event"] == "failure":
            t = e.get("detected_at", e["t"])
            out.append({"detected_at": t, "cause": e.get("cause"), "ranks": e["ranks"],
                        "gpus": e["gpus"], "reason": e["reason"], "lost_steps": e["lost_steps"],
                        "detect_s": None if fault_t is None else t - fault_t,
                        "mode": "restart"})
            fault_t = None
        elif e["event"] == "live_relayout":  # recovery.mode=live: same processes, no rollback
            t = e["detected_at"]
            out.append({"detected_at": t, "cause": e.get("cause"), "ranks": e["ranks"],
                        "gpus": e["gpus"], "reason": e["reason"], "lost_steps": e["lost_steps"],
                        "detect_s": None if fault_t is None else t - fault_t, "mode": "live",
                        "restart_s": e["relayout_s"], "resume_step": e["resume_step"],
                        "replica_tp": e["replica_tp"],
                        **{k: e[k] for k in ("relayout_s", "unblock_s", "recomputed_steps",
                                             "bytes_received_rank_max", "lower_bound_rank_max",
                                             "peak_memory_ratio", "committed_step")}})
            fault_t = None
        elif e["event"] == "scale_up":
            t = e.get("detected_at", e["t"])
            out.append({"detected_at": t, "cause": "gpu_back", "ranks": [],
                        "gpus": e["gpus"], "reason": e["reason"], "lost_steps": e["lost_steps"],
                        "detect_s": t - e["requested_at"]})
        elif e["event"] == "relayout":  # nutp.exclude_stragglers: planned, nothing lost
            out.append({"detected_at": e.get("detected_at", e["t"]),
                        "cause": e.get("cause", "straggler"),
                        "ranks": [], "gpus": e["gpus"], "reason": e["reason"],
                        "lost_steps": e["lost_steps"], "detect_s": None})
        elif e["event"] == "resumed" and out and "restart_s" not in out[-1]:
            out[-1].update(restart_s=e["t"] - out[-1]["detected_at"], resume_step=e["step"],
                           replica_tp=e["replica_tp"])
    return out


def print_summary(console: Any, summary: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if not summary:
        return
    t = Table(title="Recovery")
    for col in ("GPUs", "reason", "mode", "detect s", "restart s", "lost steps", "new TP"):
        t.add_column(col)
    for s in summary:  # live: "restart s" is relayout_s (detected -> new layout's first step)
        det = "-" if s["detect_s"] is None else f"{s['detect_s']:.2f}"
        t.add_row(str(s["gpus"]), s["reason"], s.get("mode", "restart"), det,
                  f"{s.get('restart_s', float('nan')):.2f}", str(s["lost_steps"]),
                  str(s.get("replica_tp")))
    console.print(t)


def layout_of(plan: Plan) -> list[list[int]]:
    return [list(r.tp) for r in plan.replicas]


@dataclass(frozen=True)
class ScaleUp:
    """A planned restart: ``gpus`` reported back (seen at ``requested_at``), resuming from the
    checkpoint of ``step``."""

    gpus: tuple[int, ...]
    requested_at: float
    step: int


class HealthWatch:
    """While a world runs: GPUs reported back in the health report -> a planned restart at the
    first checkpoint newer than the one complete when the report was seen."""

    def __init__(self, cfg: JobConfig, job: JobConfig, plan: Plan,
                 failed: frozenset[int], rdir: Path,
                 console: Any) -> None:
        self.cfg, self.job, self.failed, self.rdir, self.console = cfg, job, failed, rdir, console
        self.layout = layout_of(plan)
        self.next_read = 0.0
        self.seen: frozenset[int] = frozenset()
        self.pending: tuple[frozenset[int], float, int | None] | None = None

    def poll(self, now: float) -> ScaleUp | None:
        if now >= self.next_read:
            self.next_read = now + HEALTH_POLL_S
            self._read(now)
        if self.pending is None:
            return None
        gpus, since, base = self.pending
        latest = latest_step(self.job.checkpoint_dir)
        if not scale_up_due(base_step=base, latest_step=latest, total_steps=self.job.train.steps):
            return None
        assert latest is not None
        return ScaleUp(tuple(sorted(gpus)), since, latest)

    def _read(self, now: float) -> None:
        back = returned_gpus(self.failed, read_health(self.rdir / "health.json"))
        if back == self.seen:
            return
        self.seen = back
        if not back:  # reported failed again before the restart: nothing to do
            self.pending = None
            return
        from ..config import plan_request
        from ..layout import build_plan

        events = self.rdir / "events.jsonl"
        fuller = build_plan(plan_request(job_for(self.cfg, self.failed - back)))
        why = ("the layout does not change" if layout_of(fuller) == self.layout
               else scale_up_blocker(self.job))
        if why is not None:
            log_event("gpu_back", file=events, gpus=sorted(back), deferred=why)
            self.console.print(f"[yellow]recovery:[/] GPUs {sorted(back)} reported back; {why}: "
                               "they are used at the next restart")
            self.pending = None
            return
        base = (self.pending[2] if self.pending is not None
                else latest_step(self.job.checkpoint_dir))
        since = self.pending[1] if self.pending is not None else now
        self.pending = (back, since, base)
        log_event("scale_up_requested", file=events, gpus=sorted(back), base_step=base,
                  world_size=fuller.world_size, replica_tp=[list(r.tp) for r in fuller.replicas])
        self.console.print(f"[green]recovery:[/] GPUs {sorted(back)} reported back; restarting "
                           f"at {layout_of(fuller)} after the next checkpoint")


def archive_previous_run(rdir: Path, keep: tuple[str, ...] = ()) -> Path | None:
    """At the first attempt of a run: move what an earlier run left in ``rdir`` (heartbeats, exit
    records, hang/scale-up records, events, summary) to ``rdir/prev-<time>/``, so none of it is
    read as this run's evidence; the files named in ``keep`` stay (a requeued run carries the
    health report and node table over: ``CARRIED``). Returns the archive directory (None if
    there was nothing)."""
    old = ([p for p in rdir.iterdir() if not p.name.startswith("prev-") and p.name not in keep]
           if rdir.is_dir() else [])
    if not old:
        return None
    dest = rdir / f"prev-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.mkdir()
    for p in old:
        os.replace(p, dest / p.name)
    return dest


def resume_step(root: str | None) -> int:
    """The step a restart resumes at: that of the newest complete checkpoint (0 if none)."""
    from ..checkpoint import find_latest
    from ..checkpoint.store import read_marker

    latest = find_latest(root) if root else None
    marker = read_marker(latest) if latest is not None else None
    return int(marker["step"]) if marker else 0
