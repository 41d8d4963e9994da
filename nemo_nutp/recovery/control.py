"""The control process of ``recovery.mode=live``: it outlives every rank.

Runs inside the CPU supervisor (``supervisor.py``). It hosts the one ``TCPStore`` every world
of the job is built on (``world<gen>/`` prefixes; no rank hosts it, so rank 0 may die), watches
the ranks as the restart path does (``health/check.py``'s failure check) and makes
every decision of a live re-layout; ranks only report and follow (``live.py``):

1. failure found (a rank died, or hung: the hung rank is killed, it is not trusted to rejoin);
   ``commit.live_blocker`` says whether it can be handled live, else the restart path takes it;
2. ``abort<gen>`` is set: every survivor's control thread wakes (one blocking wait each, no
   polling), its current ``Work.wait`` raises (``backend.py``), the survivor reports
   ``(step, phase)``;
3. with every survivor's report: ``commit.decide`` (last committed step, who still applies it),
   the same planner and policy as a restart re-plan for the failed GPUs, ``decision<gen>``
   posted (new failed GPUs, rank -> GPU, the committed step);
4. the new world's rank 0 posts ``started<gen+1>`` when the state is moved (bytes, peak memory):
   the event ``live_relayout`` is logged (``unblock_s``: detected -> every survivor out of its
   step; ``relayout_s``: detected -> the first step of the new layout starts).

Boundary re-layouts (``grow``): GPUs reported back (health report; ``recovery/slow.json`` for
stragglers it re-planned around) or a straggler found (rank 0 posts ``boundary<gen>``, every
rank found it at the same step): ``abort<gen>`` carries a ``grow`` request that aborts nothing,
the ranks' next vote agrees on the step boundary, every rank reports ``(s, committed)``, the
planner re-plans, one new process per returning GPU joins ``world<gen+1>`` and receives its
state from the survivors; a rank whose GPU the plan leaves out exits. A rank that dies in that
window is a failure for the restart path (no live recovery inside a re-layout).

Fallbacks (each logged as ``live_fallback`` with its reason, then the restart path): the
``live_blocker`` reasons (distributed optimizer, ...), a survivor that does not report within
``REPORT_TIMEOUT_S``, a second failure while the new world is built (ranks that die before
the decision is posted, ``FOLD_S`` at the earliest, join the first failure), a broken commit
invariant, no valid plan for the survivors (the restart path then stops with the planner's
one-line error).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.env import ATTEMPT, CONTROL, EVENTS, HEARTBEAT_DIR
from ..common.events import log_event
from ..health import watch
from ..health.check import FailureCheck, hang_in
from ..health.commit import UNMOVABLE, Report, decide, live_blocker, renumber, replan
from ..health.decisions import (
    Failure,
    blame_exits,
    exit_words,
    exits_reason,
    job_for,
    next_failed,
    returned_gpus,
)

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan
    from .hosts import Host
    from .world import Attempt, RankEntry

POLL_S = 0.01  # while a re-layout waits for reports / the new world
REPORT_TIMEOUT_S = 60.0
FOLD_S = 0.5
"""A failure's decision is posted no earlier than this after it was detected: ranks that die
until then (the rest of a node, a second rank killed within a poll or two) are folded into it,
one re-layout; a rank that dies after the decision, while the new world is built, is a second
failure (the restart path)."""
START_TIMEOUT_S = 300.0


def host_store() -> tuple[Any, int]:
    """The control process's store (this process serves it)."""
    import torch.distributed as dist

    from ..common.ports import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S), use_libuv=True)
    return store, port


@dataclass
class World:
    """The running world as the control process sees it."""

    job: JobConfig
    plan: Plan
    procs: list[Any]  # by current rank
    slots: list[int]  # current rank -> the process's rank in world 0
    failed: frozenset[int]
    gen: int
    hb: Path  # heartbeat directory of this world
    next_slot: int = 0  # the slot a joiner gets (slots: process identities, never reused)
    slow: dict[int, float] = field(default_factory=dict)  # stragglers excluded (GPU -> speed)
    nodes: tuple[str, ...] = ()  # the host's node names (``hosts.Host.node_names``): reasons

    links: dict[int, float] = field(default_factory=dict)  # slow NICs planned around (GPU ->
    # relative rate; rank 0's link watch, ``train/links.py``)
    reserved: list[int] | None = None  # GPUs held back (spares, replaced slices; None: the
    # job's own ``recovery.spares``)
    spares: list[tuple[int, ...]] = field(default_factory=list)  # free spare slices
    standby: dict[int, Any] = field(default_factory=dict)  # spare GPU -> its standby process

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.exitcode is None]


class Fallback(Exception):
    """This failure goes to the restart path (the message is the reason). ``failure``: the
    failure as it stood then, with the ranks that died while it was handled (``_fold``)."""

    def __init__(self, reason: str, failure: Failure | None = None) -> None:
        super().__init__(reason)
        self.failure = failure


def _kill(p: Any) -> None:
    p.kill()  # its whole process group (``hosts.Proc``)
    p.join()


def _wait_keys(store: Any, keys: list[str], w: World, watched: list[int], timeout_s: float,
               what: str) -> None:
    deadline = time.monotonic() + timeout_s
    unmovable = f"{UNMOVABLE}{w.gen}"  # posted by ranks of the world being built (``w``)
    while not store.check(keys):
        for r in watched:
            if w.procs[r].exitcode is not None:
                if store.check([unmovable]):
                    why = json.loads(store.get(unmovable))["reason"]
                    raise Fallback(f"the state cannot move live: {why}")
                raise Fallback(f"second failure during the re-layout: rank {r} exited "
                               f"({exit_words(w.procs[r].exitcode, w.nodes)}) while {what}")
        if time.monotonic() > deadline:
            raise Fallback(f"timed out after {timeout_s:.0f} s while {what}")
        time.sleep(POLL_S)


def _died(w: World, ranks: list[int]) -> dict[int, int]:
    """Exit codes of the ranks of ``ranks`` that have exited."""
    return {r: c for r in ranks if (c := w.procs[r].exitcode) is not None}


def _fold(failure: Failure, late: dict[int, int], nodes: tuple[str, ...] = ()) -> Failure:
    """``failure`` with the ranks that died while it was handled (``late``: rank -> exit code)
    folded in: one failure, never a second one. The reason says when each was found."""
    if not late:
        return failure
    why = exits_reason(late, ranks=True, nodes=nodes)
    return Failure(tuple(sorted({*failure.ranks, *late})),
                   f"{failure.reason}; while handling it, {why}")


def _reports(store: Any, w: World, failure: Failure) -> tuple[Failure, dict[int, Any]]:
    """Every survivor's report (``report<gen>/<slot>``). A rank that dies meanwhile, before or
    after its report, is folded into the failure (``_fold``): ranks of one node, or killed
    within one poll of each other, die a few milliseconds apart, and the poll that found the
    first saw the rest alive. Returns the failure and the survivors' reports."""
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    late: dict[int, int] = {}
    unmovable = f"{UNMOVABLE}{w.gen}"
    while True:
        rest = [r for r in range(len(w.procs)) if r not in failure.ranks]
        late.update(_died(w, rest))
        survivors = [r for r in rest if r not in late]
        if not survivors:
            raise Fallback("no survivor left to re-lay out", _fold(failure, late, w.nodes))
        keys = [f"report{w.gen}/{w.slots[r]}" for r in survivors]
        if store.check(keys):
            posts = {r: json.loads(store.get(k)) for r, k in zip(survivors, keys, strict=True)}
            return _fold(failure, late, w.nodes), posts
        if late and store.check([unmovable]):
            why = json.loads(store.get(unmovable))["reason"]
            raise Fallback(f"the state cannot move live: {why}", _fold(failure, late, w.nodes))
        if time.monotonic() > deadline:
            raise Fallback(f"timed out after {REPORT_TIMEOUT_S:.0f} s while waiting for "
                           "survivors' reports", _fold(failure, late, w.nodes))
        time.sleep(POLL_S)


def swap_spares(w: World, failed: frozenset[int]
                ) -> tuple[list[int] | None, list[tuple[int, ...]],
                           list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Hot spares (``recovery.spares``): every TP slice of the running plan that lost a GPU,
    while a spare slice is free, is swapped for one (its healthy GPUs held back, the spare
    taken out of the held-back set). Returns the held-back GPUs (None: the job's own, no
    spares), the spare slices still free and the swaps (replaced slice, spare)."""
    if not w.standby and not w.spares:
        return w.reserved, list(w.spares), []
    from ..layout.plan import plan_slices

    tb = w.plan.request.parallel.tp_base
    held = set(w.reserved if w.reserved is not None else w.plan.request.health.reserved_gpus)
    spares, swaps = list(w.spares), []
    new = failed - w.failed
    slices = [tuple(range(int(s), int(s) + tb)) for s in plan_slices(w.plan.request)[0]]
    used = {s for s in slices if set(s) & set(w.plan.rank_to_gpu)}
    for worn in sorted({s for s in used if new & set(s)}):
        if not spares:
            break
        spare = spares.pop(0)
        held = (held - set(spare)) | (set(worn) - failed)
        swaps.append((worn, spare))
    return sorted(held), spares, swaps


def refill_spares(w: World, back: frozenset[int]) -> list[tuple[int, ...]]:
    """GPUs reported back that make a held-back (replaced) slice whole again: those slices go
    back to the spare pool first (``recovery.spares``), before any grow. Returns them (w is
    updated: the GPUs no longer failed, held back, the slices free spares)."""
    if w.reserved is None or not back:
        return []
    from ..layout.plan import plan_slices

    tb = w.plan.request.parallel.tp_base
    held, failed = set(w.reserved), w.failed - back
    out = []
    for st in plan_slices(w.plan.request)[0]:
        s = tuple(range(int(st), int(st) + tb))
        if set(s) & back and set(s) <= held | back and not set(s) & failed:
            out.append(s)
    gpus = {g for s in out for g in s}
    if out:
        w.failed = w.failed - gpus
        w.reserved = sorted(held | gpus)
        w.spares = [*w.spares, *out]
    return out


def activate_standby(store: Any, proc: Any, gpu: int, slot: int, old_plan: Plan, gen: int,
                     hb: Path) -> Any:
    """Wake ``gpu``'s standby process (``world.standby_main``): it joins world ``gen`` as
    ``slot``, its state moved from the survivors. Returns its handle."""
    import pickle

    from .world import STANDBY_KEY

    store.set(STANDBY_KEY.format(gpu=gpu), pickle.dumps((slot, old_plan, gen, str(hb))))
    return proc


def relayout(store: Any, cfg: JobConfig, w: World, failure: Failure, *, detected: float,
             rdir: Path, attempt: int) -> tuple[World, dict[str, Any]]:
    """Steps 2-4 of the module docstring. Returns the new world and the event's fields;
    raises ``Fallback``. Ranks that die before the decision is posted (at least ``FOLD_S``
    after ``detected``) join the failure (``_reports``); one that dies after it, while the new
    world is built, is a second failure (the restart path)."""
    for r in failure.ranks:  # a hung rank is not trusted to rejoin
        _kill(w.procs[r])
    store.set(f"abort{w.gen}", failure.reason)
    folded = [failure]  # the failure with its late deaths, for a Fallback raised below
    try:
        return _relayout(store, cfg, w, folded, detected=detected, rdir=rdir, attempt=attempt)
    except Fallback as e:
        raise Fallback(str(e), e.failure or folded[0]) from None


def _relayout(store: Any, cfg: JobConfig, w: World, folded: list[Failure], *, detected: float,
              rdir: Path, attempt: int) -> tuple[World, dict[str, Any]]:
    while True:
        failure, posts = _reports(store, w, folded[0])
        folded[0] = failure
        survivors = sorted(posts)
        out_at = max(p["out_at"] for p in posts.values())
        try:
            dec = decide({r: Report(p["step"], p["phase"]) for r, p in posts.items()})
        except RuntimeError as e:
            raise Fallback(str(e)) from None
        gpus = tuple(w.plan.rank_to_gpu[r] for r in failure.ranks)
        failed = next_failed(w.failed, gpus, watch.read_health(rdir / "health.json"))
        reserved, spares, swaps = swap_spares(w, failed)
        job = job_for(cfg, failed, w.slow, w.links, reserved)
        try:
            plan = replan(w.plan, job)
        except ValueError as e:
            raise Fallback(f"no valid plan for the survivors: {e}") from None
        time.sleep(max(0.0, detected + FOLD_S - time.time()))
        if not _died(w, survivors):  # else: fold the late deaths, decide again
            break
    from ..relayout.plan import plan_move

    rank_map = {o: n for o, n in renumber(tuple(w.plan.rank_to_gpu),
                                          tuple(plan.rank_to_gpu)).items()
                if n is not None and o not in failure.ranks}
    joiners = sorted(set(range(plan.world_size)) - set(rank_map.values()))  # spares' ranks
    missing = [plan.rank_to_gpu[n] for n in joiners if plan.rank_to_gpu[n] not in w.standby]
    if missing:
        raise Fallback(f"GPUs {missing} of the new layout have no process (no standby)")
    mv = plan_move(w.plan, plan, rank_map, joiners=frozenset(joiners))
    if not mv.possible:
        raise Fallback(f"state cannot move: {mv.reason}")
    watch.write_health(rdir / "health.json", failed)
    gen = w.gen + 1
    hb = rdir / f"heartbeats.{attempt}.live{gen}"
    hb.mkdir(parents=True, exist_ok=True)
    store.set(f"decision{w.gen}", json.dumps({
        "action": "live", "step": dec.step, "apply": [w.slots[r] for r in dec.apply],
        "failed_gpus": sorted(failed), "rank_to_gpu": list(plan.rank_to_gpu),
        "dead_ranks": list(failure.ranks), "detected_at": detected, "heartbeat_dir": str(hb),
        "slow_gpus": {str(g): v for g, v in w.slow.items()},
        "slow_links": {str(g): v for g, v in w.links.items()},
        "reserved_gpus": reserved, "joiners": joiners}))
    inv = {n: o for o, n in rank_map.items()}
    new_procs, new_slots, nxt = [], [], w.next_slot
    standby = dict(w.standby)
    for n, g in enumerate(plan.rank_to_gpu):
        if n in inv:
            new_procs.append(w.procs[inv[n]])
            new_slots.append(w.slots[inv[n]])
            continue
        new_procs.append(activate_standby(store, standby.pop(g), g, nxt, w.plan, gen, hb))
        new_slots.append(nxt)
        nxt += 1
    nw = World(job, plan, new_procs, new_slots, failed, gen, hb, nxt, dict(w.slow),
               w.nodes, dict(w.links), reserved, spares, standby)
    _wait_keys(store, [f"started{gen}"], nw, list(range(len(new_procs))), START_TIMEOUT_S,
               "the new world was being built")
    started = json.loads(store.get(f"started{gen}"))
    for r in survivors:  # healthy GPUs the new layout does not use leave by themselves
        if w.plan.rank_to_gpu[r] not in plan.rank_to_gpu:
            w.procs[r].join(timeout=30)
    fields = {"attempt": attempt, "gen": gen, "ranks": list(failure.ranks), "gpus": list(gpus),
              "reason": failure.reason, "detected_at": detected,
              "unblock_s": max(0.0, out_at - detected),
              "relayout_s": started["t"] - detected, "committed_step": dec.step,
              "resume_step": started["resume_step"], "lost_steps": 0,
              "recomputed_steps": max(p["step"] for p in posts.values()) - dec.step,
              "applied_by": [w.slots[r] for r in dec.apply],
              "bytes_received_rank_max": started["bytes_received_rank_max"],
              "lower_bound_rank_max": started["lower_bound_rank_max"],
              "peak_memory_ratio": started["peak_memory_ratio"], "move_s": started["move_s"],
              "checkpoint_bytes_read": 0, "processes_started": 0,
              "world_size": plan.world_size, "replica_tp": watch.layout_of(plan),
              "pids": [p.pid for p in new_procs],
              "spares_used": [list(spare) for _, spare in swaps],
              "replaced_slices": [list(worn) for worn, _ in swaps],
              "spares_free": len(spares), "joiners": joiners}
    return nw, fields


class Finished(Exception):
    """Every rank ended the job (0) before the grow-back boundary: nothing to re-lay out."""


def _wait_boundary(store: Any, keys: list[str], w: World, timeout_s: float) -> None:
    """Every rank's report at the grow-back boundary; ``Finished`` if they all ended first."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        codes = [p.exitcode for p in w.procs]
        if all(c == 0 for c in codes):
            raise Finished()
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            why = exit_words(codes[bad[0]] or 0, w.nodes)
            raise Fallback(f"rank {bad[0]} exited ({why}) before the grow-back boundary")
        if time.monotonic() > deadline:
            raise Fallback(f"timed out after {timeout_s:.0f} s waiting for the grow-back "
                           "boundary")
        time.sleep(POLL_S)


SLOW_FILE = "slow.json"
"""``<output.dir>/recovery/slow.json``: the stragglers a live job excluded (``slow_gpus``,
written by the control process); an operator removes a GPU from it to give it back."""


def read_slow(rdir: Path) -> dict[int, float] | None:
    try:
        return {int(g): float(v) for g, v in
                json.loads((rdir / SLOW_FILE).read_text())["slow_gpus"].items()}
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def _posted_slow(store: Any, w: World) -> tuple[dict[int, float], dict[int, float] | None]:
    """What rank 0 asked to re-lay out around at this world's boundary (``boundary<gen>``):
    stragglers (``nutp.exclude_stragglers``) and, when its link watch changed them, the slow
    NICs now (the whole set; None: unchanged)."""
    key = f"boundary{w.gen}"
    if not store.check([key]):
        return {}, None
    post = json.loads(store.get(key))
    links = post.get("slow_links")
    return ({int(g): float(v) for g, v in post.get("slow_gpus", {}).items()},
            None if links is None else {int(g): float(v) for g, v in links.items()})


def _grow_plan(store: Any, cfg: JobConfig, w: World, rdir: Path
               ) -> tuple[frozenset[int], dict[int, float], dict[int, float], Any, Any,
                          dict[int, int], list[int]]:
    """Failed GPUs, stragglers, slow NICs, job, plan, survivors' rank map and joiners (new
    ranks) of a boundary re-layout. The reports are read again here: every GPU reported back (health
    report, ``slow.json``) until every rank stopped at the boundary joins this one re-layout
    (close returns batched), and a straggler found meanwhile is excluded by it too."""
    from ..health.decisions import returned_gpus
    from ..relayout.plan import plan_move, survivor_rank_map

    failed = w.failed - returned_gpus(w.failed, watch.read_health(rdir / "health.json"))
    listed = read_slow(rdir)
    slow = {g: v for g, v in w.slow.items() if listed is None or g in listed}
    posted, links = _posted_slow(store, w)
    slow.update(posted)
    links = dict(w.links) if links is None else links
    job = job_for(cfg, failed, slow, links, w.reserved)
    try:
        plan = replan(w.plan, job)
    except ValueError as e:
        raise Fallback(f"no valid plan for the new health: {e}") from None
    rank_map = survivor_rank_map(w.plan, plan)
    joiners = sorted(set(range(plan.world_size)) - set(rank_map.values()))
    mv = plan_move(w.plan, plan, rank_map, joiners=frozenset(joiners))
    if not mv.possible:
        raise Fallback(f"state cannot move: {mv.reason}")
    return failed, slow, links, job, plan, rank_map, joiners


def grow(store: Any, cfg: JobConfig, w: World, why: str, *, detected: float, rdir: Path,
         attempt: int, start_joiner: Any) -> tuple[World, dict[str, Any]]:
    """A re-layout at a step boundary (GPUs back, a straggler excluded or back): every rank
    stops at the step boundary its vote agrees on (``health.commit.GROW``; a straggler: the step its
    detection found it, the same on every rank), reports, the planner re-plans, one new process
    per returning GPU is started (``start_joiner(slot, old_plan, gpu, gen, heartbeat_dir)``)
    and joins the next world, where it receives its state from the survivors; a rank whose GPU
    the new plan leaves out exits. Returns the new world and the event's fields; raises
    ``Fallback`` or ``Finished``."""
    from ..health.commit import GROW

    ranks = w.alive()
    store.set(f"abort{w.gen}", f"{GROW}: {why}")
    keys = [f"report{w.gen}/{w.slots[r]}" for r in ranks]
    _wait_boundary(store, keys, w, REPORT_TIMEOUT_S + 30 * w.job.recovery.heartbeat_timeout_s)
    posts = {r: json.loads(store.get(k)) for r, k in zip(ranks, keys, strict=True)}
    try:
        dec = decide({r: Report(p["step"], p["phase"]) for r, p in posts.items()})
    except RuntimeError as e:
        raise Fallback(str(e)) from None
    out_at = max(p["out_at"] for p in posts.values())
    failed, slow, links, job, plan, rank_map, joiners = _grow_plan(store, cfg, w, rdir)
    watch.write_health(rdir / "health.json", failed)
    from ..layout.serialize import write_json_atomic

    write_json_atomic({"slow_gpus": {str(g): v for g, v in sorted(slow.items())}},
                      rdir / SLOW_FILE)
    gen = w.gen + 1
    hb = rdir / f"heartbeats.{attempt}.live{gen}"
    hb.mkdir(parents=True, exist_ok=True)
    store.set(f"decision{w.gen}", json.dumps({
        "action": "live", "step": dec.step, "apply": [], "failed_gpus": sorted(failed),
        "slow_gpus": {str(g): v for g, v in slow.items()},
        "slow_links": {str(g): v for g, v in links.items()}, "reserved_gpus": w.reserved,
        "rank_to_gpu": list(plan.rank_to_gpu), "dead_ranks": [], "joiners": joiners,
        "detected_at": detected, "heartbeat_dir": str(hb)}))
    inv = {n: o for o, n in rank_map.items()}
    procs, slots, nxt = [], [], w.next_slot
    for n in range(plan.world_size):
        if n in inv:
            procs.append(w.procs[inv[n]])
            slots.append(w.slots[inv[n]])
            continue
        procs.append(start_joiner(nxt, w.plan, plan.rank_to_gpu[n], gen, hb))
        slots.append(nxt)
        nxt += 1
    nw = World(job, plan, procs, slots, failed, gen, hb, nxt, slow, w.nodes, links, w.reserved,
               list(w.spares), dict(w.standby))
    joined = [procs[n] for n in joiners]
    log_event("live_joiners", file=rdir / "events.jsonl", gen=gen, joiners=joiners,
              pids=[p.pid for p in joined])
    try:
        _wait_keys(store, [f"started{gen}"], nw, list(range(len(procs))), START_TIMEOUT_S,
                   "the new world was being built")
    except Fallback:
        for p in joined:  # not members of the world the restart path stops
            _kill(p)
        raise
    started = json.loads(store.get(f"started{gen}"))
    for r in ranks:  # healthy GPUs the new layout does not use leave by themselves
        if r not in rank_map:
            w.procs[r].join(timeout=30)
    back = sorted((w.failed - failed) | (set(w.slow) - set(slow)))
    left = sorted(set(slow) - set(w.slow))
    nics = sorted(set(links) ^ set(w.links))  # slow NICs found or recovered
    return nw, {"attempt": attempt, "gen": gen, "ranks": [w.slots[r] for r in ranks
                                                          if r not in rank_map],
                "gpus": back or left or nics, "excluded_gpus": left, "returned_gpus": back,
                "slow_links": {str(g): v for g, v in sorted(links.items())},
                "reason": ("straggler" if left else "GPU back" if back else
                           "slow link" if set(links) - set(w.links) else "link recovered"),
                "detected_at": detected,
                "unblock_s": max(0.0, out_at - detected),
                "relayout_s": started["t"] - detected, "committed_step": dec.step,
                "resume_step": started["resume_step"], "lost_steps": 0, "recomputed_steps": 0,
                "applied_by": [], "joiners": joiners,
                "bytes_received_rank_max": started["bytes_received_rank_max"],
                "lower_bound_rank_max": started["lower_bound_rank_max"],
                "peak_memory_ratio": started["peak_memory_ratio"], "move_s": started["move_s"],
                "checkpoint_bytes_read": 0, "processes_started": len(joiners),
                "world_size": plan.world_size, "replica_tp": watch.layout_of(plan),
                "pids": [p.pid for p in procs]}


def gpus_back(cfg: JobConfig, w: World, rdir: Path) -> tuple[frozenset[int], str | None]:
    """GPUs of the running world the health report (failed) or ``slow.json`` (excluded
    stragglers) gives back, and why they are not taken in now (None: grow back live)."""
    from ..config import plan_request
    from ..health.decisions import returned_gpus
    from ..layout import build_plan

    back = returned_gpus(w.failed, watch.read_health(rdir / "health.json"))
    listed = read_slow(rdir)
    slow_back = frozenset(g for g in w.slow if listed is not None and g not in listed)
    if not back and not slow_back:
        return frozenset(), None
    slow = {g: v for g, v in w.slow.items() if g not in slow_back}
    fuller = build_plan(plan_request(job_for(cfg, w.failed - back, slow, w.links, w.reserved)))
    if watch.layout_of(fuller) == watch.layout_of(w.plan):
        return back | slow_back, "the layout does not change"
    return back | slow_back, None


def handle_grow(store: Any, cfg: JobConfig, w: World, back: frozenset[int], *, rdir: Path,
                attempt: int, console: Any, start_joiner: Any) -> World | str | None:
    """A boundary re-layout (``back``: GPUs reported back; empty: rank 0 posted a straggler):
    the new world, the fallback reason, or None (the job ended first)."""
    events = rdir / "events.jsonl"
    why = f"GPUs {sorted(back)} back" if back else "straggler excluded or a link changed"
    if back:
        log_event("scale_up_requested", file=events, gpus=sorted(back), mode="live", gen=w.gen)
    detected = time.time()
    try:
        nw, fields = grow(store, cfg, w, why, detected=detected, rdir=rdir, attempt=attempt,
                          start_joiner=start_joiner)
    except Finished:
        return None
    except Fallback as e:
        store.set(f"decision{w.gen}", json.dumps({"action": "restart", "reason": str(e)}))
        log_event("live_fallback", file=events, attempt=attempt, gen=w.gen, ranks=[],
                  reason=str(e))
        console.print(f"[yellow]recovery:[/] live re-layout not possible ({e}): planned "
                      "restart from the newest checkpoint")
        return str(e)
    cause = ("straggler" if fields["excluded_gpus"] else "gpu_back" if fields["returned_gpus"]
             else "slow_link")
    why = fields["reason"] if cause == "slow_link" else why
    log_event("live_relayout", file=events, cause=cause, **fields)
    console.print(f"[green]recovery:[/] {why}: live re-layout to {fields['replica_tp']} in "
                  f"{fields['relayout_s']:.2f} s ({fields['processes_started']} processes "
                  f"started), continuing at step {fields['resume_step']}")
    return nw


def handle(store: Any, cfg: JobConfig, w: World, failure: Failure, cause: str, *, detected: float,
           rdir: Path, attempt: int, console: Any) -> World | Failure:
    """A failure of the running world: the next world (live), or the failure the restart path
    takes (with the ranks that died while it was handled: their GPUs are marked failed too)."""
    events = rdir / "events.jsonl"
    survivors = [r for r in w.alive() if r not in failure.ranks]  # a dead blamed rank is not alive
    reason = live_blocker(w.job, failure, survivors=len(survivors),
                          replicas=len(w.plan.replicas))
    if reason is None:
        try:
            nw, fields = relayout(store, cfg, w, failure, detected=detected, rdir=rdir,
                                  attempt=attempt)
        except Fallback as e:
            reason, failure = str(e), e.failure or failure
        else:
            log_event("live_relayout", file=events, cause=cause, **fields)
            console.print(f"[yellow]recovery:[/] ranks {fields['ranks']} (GPUs "
                          f"{fields['gpus']}) failed: {fields['reason']}; live re-layout to "
                          f"{fields['replica_tp']} in {fields['relayout_s']:.2f} s (unblock "
                          f"{fields['unblock_s']:.2f} s), continuing at step "
                          f"{fields['resume_step']}")
            return nw
    if not failure.bad_input:
        store.set(f"decision{w.gen}", json.dumps({"action": "restart", "reason": reason}))
        log_event("live_fallback", file=events, attempt=attempt, gen=w.gen,
                  ranks=list(failure.ranks), reason=reason)
        console.print(f"[yellow]recovery:[/] live re-layout not possible ({reason}): "
                      "restarting from the newest checkpoint")
    return failure


def _fell_back(w: World, back: frozenset[int], now: float
               ) -> tuple[Failure | None, watch.ScaleUp | None]:
    """A boundary re-layout (grow back, straggler) that fell back: the restart path re-plans.
    A rank that died in the window is a failure (its GPU is marked failed); else a planned
    restart that takes ``back`` in at the newest checkpoint."""
    failure = blame_exits({r: p.exitcode for r, p in enumerate(w.procs)}, w.nodes)
    scale = None if failure is not None else watch.ScaleUp(
        tuple(sorted(back)), now, watch.resume_step(w.job.checkpoint_dir))
    return failure, scale


def run_world(cfg: JobConfig, job: JobConfig, plan: Plan,
              failed: frozenset[int], attempt: int, rdir: Path,
              console: Any, host: Host | None = None, entry: RankEntry | None = None
              ) -> Attempt:
    """``supervisor._run_world`` for ``recovery.mode=live``: one world of processes through any
    number of live re-layouts; returns the supervisor's ``Attempt`` when the job ends or a
    failure falls back to the restart path. ``host`` (``hosts.py``) starts and stops the
    processes: this machine's fork server (default) or a cluster's node agents. ``entry``:
    how this machine's fork server starts a rank and a joiner (``nutp-bridge``'s; default
    ``nutp-train``'s)."""
    from .hosts import LocalHost
    from .world import Attempt

    host = LocalHost(entry) if host is None else host
    store, port = host_store()
    hb = rdir / f"heartbeats.{attempt}"
    hb.mkdir(parents=True, exist_ok=True)
    env = {ATTEMPT: str(attempt), HEARTBEAT_DIR: str(hb), EVENTS: str(rdir / "events.jsonl"),
           CONTROL: f"{host.address}:{port}"}
    procs = host.start_world(job, plan, env)
    log_event("live_world", file=rdir / "events.jsonl", attempt=attempt, gen=0,
              pids=[p.pid for p in procs])
    w = World(job, plan, procs, list(range(plan.world_size)), failed, 0, hb, plan.world_size,
              nodes=host.node_names, links=dict(plan.request.health.slow_links))
    if job.recovery.spares:  # hot spares: standby processes, started with the job
        from ..layout.plan import spare_slices

        w.spares = spare_slices(job.cluster, job.parallel.tp_base, job.recovery.spares)
        w.standby = {g: host.start_standby(job, g, env) for s in w.spares for g in s}
        log_event("spares_standby", file=rdir / "events.jsonl", slices=[list(s) for s in w.spares],
                  pids=[p.pid for p in w.standby.values()])

    def start_joiner(slot: int, old_plan: Plan, gpu: int, gen: int, hb: Path) -> Any:
        return host.start_joiner(slot, job, old_plan, gpu, gen,
                                 {**env, HEARTBEAT_DIR: str(hb)})

    health_watch = watch.HealthWatch(cfg, job, plan, failed, rdir, console)
    started = next_health = time.time()
    check = FailureCheck(started)
    seen: frozenset[int] = frozenset()
    watched: tuple[World | None, Any] = (None, None)  # the world the hang aggregator follows

    def hang(now: float) -> Failure | None:
        """The running world's hang: the host's aggregator over node digests
        (``hosts.AgentHost.watch``), else the ranks' files are read here."""
        nonlocal watched
        if watched[0] is not w:  # a new world: the host's node watchdogs follow it
            watched = (w, host.watch(w, started=started, rec=job.recovery))
        if watched[1] is not None:
            return watched[1].poll(now)
        return hang_in(w.hb, w.plan.world_size, now=now, started=started, rec=job.recovery)

    def planned(now: float) -> watch.ScaleUp | None:
        """GPUs back under the distributed optimizer (no live moves of its slices yet): a
        planned restart, from world 0 only."""
        return health_watch.poll(now) if w.gen == 0 else None

    while True:
        time.sleep(0.05)
        now = time.time()
        v = check.poll({r: p.exitcode for r, p in enumerate(w.procs)}, now=now, hang=hang,
                       health=planned if job.train.distributed_optimizer else None,
                       nodes=w.nodes)
        if v.done:
            host.stop(list(w.standby.values()))  # spares still standing by: the job is over
            return Attempt(True, None, None, None, now, None, tuple(w.plan.rank_to_gpu), {},
                           0.0)
        failure, cause, scale = v.failure, v.cause, v.scale_up
        fell_back = False  # a boundary re-layout fell back
        grows = failure is None and not job.train.distributed_optimizer  # live, at a boundary
        if grows and store.check([f"boundary{w.gen}"]):  # a straggler
            res = handle_grow(store, cfg, w, frozenset(), rdir=rdir, attempt=attempt,
                              console=console, start_joiner=start_joiner)
            if res is None or isinstance(res, World):
                w, started = (w, started) if res is None else (res, time.time())
                continue
            # the fallback: stop the world, the restart path re-plans (a rank that died in
            # the window is a failure: its GPU is marked failed)
            fell_back, cause = True, "exit"
            failure, scale = _fell_back(w, frozenset(), now)
        elif grows and now >= next_health:
            next_health = now + watch.HEALTH_POLL_S
            back = returned_gpus(w.failed, watch.read_health(rdir / "health.json"))
            refilled = refill_spares(w, back)
            if refilled:  # a replaced slice whole again: a spare first, the layout unchanged
                for sl in refilled:
                    w.standby.update({g: host.start_standby(job, g, env) for g in sl})
                watch.write_health(rdir / "health.json", w.failed)
                log_event("spare_refilled", file=rdir / "events.jsonl",
                          slices=[list(sl) for sl in refilled], spares_free=len(w.spares),
                          pids=[w.standby[g].pid for sl in refilled for g in sl])
                console.print(f"[green]recovery:[/] GPUs {sorted(back)} back: slices "
                              f"{[list(sl) for sl in refilled]} are hot spares again")
                continue
            back, why = gpus_back(cfg, w, rdir)
            if back and back != seen and why is not None:
                log_event("gpu_back", file=rdir / "events.jsonl", gpus=sorted(back), deferred=why)
                console.print(f"[yellow]recovery:[/] GPUs {sorted(back)} reported back; {why}: "
                              "they are used at the next restart")
            seen = back
            if back and why is None:
                res = handle_grow(store, cfg, w, back, rdir=rdir, attempt=attempt,
                                  console=console, start_joiner=start_joiner)
                if res is None or isinstance(res, World):
                    w, started = (w, started) if res is None else (res, time.time())
                    continue
                fell_back, cause = True, "exit"
                failure, scale = _fell_back(w, back, now)
        if failure is None and scale is None:
            continue
        detected = time.time()
        if failure is not None and not fell_back:
            assert cause is not None  # the check names the cause of every failure
            out = handle(store, cfg, w, failure, cause, detected=detected, rdir=rdir,
                         attempt=attempt, console=console)
            if isinstance(out, World):
                w, started = out, time.time()
                continue
            failure = out
        where = {r: watch.read_where(w.hb, r)
                 for r in (failure.ranks if failure is not None else ())}
        last = watch.last_done(w.hb, w.plan.world_size)
        host.stop([*w.procs, *w.standby.values()])
        return Attempt(False, failure, None if failure is None else cause, scale, detected,
                       last, tuple(w.plan.rank_to_gpu), where, time.time() - detected)
