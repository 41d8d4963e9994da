"""The training loop's side of a live re-layout (``recovery.mode=live``): arm a run's
session with the commit vote and the phase faults, and turn a stopped world into the next
one in the same process (``live.py`` has the protocol, ``commit.py`` its invariants)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .commit import UNMOVABLE, renumber, replan
from .live import Committed, LiveRank, move, reduce_max

EXIT_FALLBACK = 3
"""A rank told to leave because the control process falls back to a restart."""


def arm(run: Any, link: LiveRank) -> None:
    """Vote before every update; record the committed step's grad norm; faults (tests)."""
    inj = link.injector
    session = run.session

    def vote(loss: float) -> None:
        if inj is not None:
            inj.fire("vote", step=link.step, gen=link.gen)
        link.vote(loss)

    session.vote = vote
    step = session.step

    def stepped(*a: Any, **k: Any) -> Any:
        res = step(*a, **k)
        link.stepped(None if res.skipped else res.grad_norm)
        return res

    session.step = stepped
    run.live_mode = True
    if inj is not None:
        inj.arm(session, lambda: (link.step, link.gen))


def _apply(old: Any, link: LiveRank, step: int) -> None:
    """Complete the committed step from the gradients this rank holds (voted, result lost)."""
    from ..train.step import optimizer_step

    if getattr(old.optimizer, "nutp_zero", False):  # its slices only: no all-gather in the
        old.optimizer.local_only = True  # stopped world (the move rebuilds the parameters)
    ok, norm = optimizer_step(old.model, old.optimizer, old.opts, old.checks, step=step)
    link.committed = Committed(step, link.loss, norm if ok else None,
                               step_s=time.perf_counter() - link.began)


def _missing_row(run: Any, link: LiveRank, step: int) -> None:
    """Rank 0 of the new world: the committed step's row, if the old world stopped before
    its rank 0 wrote it (metrics continue without a gap)."""
    out = run.out
    if out is None or step < 0 or (out.rows and out.rows[-1]["step"] >= step):
        return
    c = link.committed
    assert c.step == step, (c, step)
    tokens = run.cfg.train.global_batch_size * run.cfg.model.seq_length
    step_s = max(c.step_s, 1e-9)  # this rank's own time to the vote: the world is gone
    out.write({"step": step, "loss": c.loss, "grad_norm": c.grad_norm,
               "skipped": c.grad_norm is None, "loss_scale": 1.0, "tokens": tokens,
               "step_time_s": step_s, "tokens_per_s": tokens / step_s,
               "goodput": run.ledger.goodput, "step_goodput": 0.0,
               "microbatches": [r.microbatches for r in link.old_replica_tp],
               "replica_tp": [list(r.tp) for r in link.old_replica_tp], "reshard_bytes_rank0": 0,
               "recovered_row": True})


def final_check(run: Any, link: LiveRank) -> None:
    """``NUTP_LIVE_DIGEST=1`` (tests), at the end of the job: the replicas' digests and, under
    the distributed optimizer, the largest difference between an optimizer slice's copy and
    its primary (``live_final``; 0.0: bit for bit). Collective."""
    if os.environ.get("NUTP_LIVE_DIGEST") != "1":
        return
    from ..checkpoint.events import log_event

    check = getattr(run.session.optimizer, "check_backups", None)
    worst = reduce_max([check() if check is not None else 0.0], None)[0]
    _digest(run.session, link.gen, event="live_final")
    if dist.get_rank() == 0:
        log_event("live_final_slices", gen=link.gen, backup_max_diff=worst,
                  redundancy=bool(getattr(run.session.optimizer, "redundancy", False)))


def _digest(session: Any, gen: int, *, event: str = "live_digest") -> None:
    """``NUTP_LIVE_DIGEST=1`` (tests): rank 0 logs a digest of every replica's assembled global
    parameters (``event``); replicas are bitwise equal iff their digests are."""
    import hashlib

    from ..checkpoint.events import log_event
    from ..model.assemble import assemble
    from ..model.init import normalize_name

    ctx = session.groups.ctx
    shards = {getattr(p, "nutp_name", normalize_name(n)) if not getattr(p, "nutp_tied_copy",
                                                                        False)
              else "tied_copy:" + getattr(p, "nutp_name", normalize_name(n)):
              (getattr(p, "nutp_kind", None), getattr(p, "nutp_units", None),
               p.detach().float().clone().view(p.shape))
              for n, p in session.model.named_parameters()}
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (ctx.replica, ctx.stage, shards))
    if dist.get_rank() != 0:
        return
    plan = session.plan
    for i in range(len(plan.replicas)):
        merged: dict[str, torch.Tensor] = {}
        for stage in range(plan.pp):
            merged.update(assemble([s for r, st, s in got if (r, st) == (i, stage)],
                                   plan.request.model))
        h = hashlib.sha256()
        for k in sorted(merged):
            h.update(k.encode())
            h.update(merged[k].contiguous().numpy().tobytes())
        log_event(event, gen=gen, replica=i, digest=h.hexdigest())


def relayout(cfg: Any, run: Any, link: LiveRank, error: BaseException | None, *,
             device: torch.device | None, make_run: Any, build: Any) -> tuple[Any, int]:
    """The world this rank trained in stopped (``error``; None: at the step boundary the vote
    agreed on, GPUs are back): report, follow the control process's decision, join the next
    world with the state moved. Returns the new run and the step it starts at (last
    committed + 1)."""
    from .decisions import job_for

    if error is None:
        link.boundary()
    else:
        link.stop(error)
    inj = link.injector
    if inj is not None:
        inj.fire("relayout", step=link.step, gen=link.gen)
    d = link.decision()
    if d["action"] != "live":
        os._exit(EXIT_FALLBACK)  # the control process stops every rank and restarts the job
    old = run.session
    if link.slot in d["apply"]:
        _apply(old, link, d["step"])
    c = link.committed
    if c.step == d["step"] and c.grad_norm is None and getattr(old.optimizer, "nutp_zero",
                                                                False):
        # stopped in the parameter all-gather after its update: the step's norm (the sync's)
        c.grad_norm = math.sqrt(old.model.nutp_engine.grad_sumsq)
    job = job_for(cfg, frozenset(d["failed_gpus"]), _slow(d))
    plan = replan(old.plan, job)
    if list(plan.rank_to_gpu) != d["rank_to_gpu"]:
        raise RuntimeError(f"re-planned rank_to_gpu={list(plan.rank_to_gpu)} but the control "
                           f"process decided {d['rank_to_gpu']} (same code and config?)")
    gpu = old.plan.rank_to_gpu[dist.get_rank()]
    link.old_replica_tp = old.plan.replicas
    if run.out is not None:
        run.out.file.close()  # rows stay in the .partial file; the new rank 0 reopens it
    rng = torch.get_rng_state()
    if gpu not in plan.rank_to_gpu:  # healthy but unused by the new layout
        os._exit(0)
    rank = list(plan.rank_to_gpu).index(gpu)
    link.rejoin(rank=rank, world=plan.world_size, device=device)
    os.environ["NUTP_HEARTBEAT_DIR"] = d["heartbeat_dir"]
    session = build(job, plan, device)
    rank_map = _rank_map(old.plan, plan, d)
    # gone: dead, or healthy but left out by the new plan (those exited above)
    gone = frozenset(range(old.plan.world_size)) - set(rank_map)
    from ..relayout.move import MoveImpossible

    try:
        stats = move(old, session, old_plan=old.plan, rank_map=rank_map,
                     joiners=frozenset(d.get("joiners", ())), dead=gone)
    except MoveImpossible as e:  # the same transfer list on every rank: all of them land here
        link.post(UNMOVABLE, {"reason": str(e), "slot": link.slot})
        os._exit(EXIT_FALLBACK)  # the control process restarts the job, naming the reason
    del old
    run.session = None
    ledger, rng = _share(d, rank_map, run.ledger, rng)
    torch.set_rng_state(rng)
    return _start(job, plan, session, d, link, ledger, stats, device=device, make_run=make_run)


def _slow(d: dict[str, Any]) -> dict[int, float]:
    """Stragglers the decision re-plans around (GPU -> relative speed)."""
    return {int(g): float(v) for g, v in d.get("slow_gpus", {}).items()}


def _rank_map(old_plan: Any, plan: Any, d: dict[str, Any]) -> dict[int, int]:
    """Old rank -> new rank of the survivors (by GPU identity)."""
    return {o: n for o, n in renumber(tuple(old_plan.rank_to_gpu),
                                      tuple(plan.rank_to_gpu)).items()
            if n is not None and o not in d["dead_ranks"]}


def _share(d: dict[str, Any], rank_map: dict[int, int], ledger: Any, rng: torch.Tensor
           ) -> tuple[Any, torch.Tensor]:
    """Joiners (grow back) take the goodput ledger and the RNG state from the lowest new rank
    of a survivor (one broadcast over the new world, only when the decision has joiners)."""
    if not d.get("joiners"):
        return ledger, rng
    box = [ledger, rng]
    dist.broadcast_object_list(box, src=min(rank_map.values()))
    if ledger is None:
        return box[0], box[1]
    return ledger, rng


def _start(job: Any, plan: Any, session: Any, d: dict[str, Any], link: LiveRank, ledger: Any,
           stats: dict[str, Any], *, device: torch.device | None, make_run: Any
           ) -> tuple[Any, int]:
    """The new world's run from the moved state; rank 0 posts ``started<gen>``."""
    ledger.failed_gpus = len(plan.request.health.failed_gpus)
    ledger.idle_gpus = plan.idle_healthy_gpus
    ledger.add_pause("relayout", max(0.0, time.time() - d["detected_at"]))
    start = d["step"] + 1
    new = make_run(job, plan, session, start=start, ledger=ledger)
    _missing_row(new, link, d["step"])
    arm(new, link)
    if os.environ.get("NUTP_LIVE_DIGEST") == "1":
        _digest(session, link.gen)
    mx = reduce_max([stats["received_bytes"], stats["lower_bound_bytes"],
                     stats["peak_memory_ratio"], stats["move_s"]], device)
    if dist.get_rank() == 0:
        link.post("started", {"t": time.time(), "bytes_received_rank_max": int(mx[0]),
                              "lower_bound_rank_max": int(mx[1]), "peak_memory_ratio": mx[2],
                              "move_s": mx[3], "resume_step": start})
    return new, start


def join(cfg: Any, old_plan: Any, link: LiveRank, gpu: int, *, device: torch.device | None,
         make_run: Any, build: Any) -> tuple[Any, int]:
    """A returning GPU's new process (grow back): join world ``link.gen`` at the rank the
    control process's decision gives this GPU, build the session, receive weights, masters and
    optimizer state from the survivors (no checkpoint read), the ledger and RNG state from a
    survivor. Returns the run and the step it starts at. ``old_plan``: the stopped world's;
    ``gpu``: this process's GPU."""
    from .decisions import job_for

    d = json.loads(link.store.get(f"decision{link.gen - 1}"))
    job = job_for(cfg, frozenset(d["failed_gpus"]), _slow(d))
    plan = replan(old_plan, job)
    if list(plan.rank_to_gpu) != d["rank_to_gpu"]:
        raise RuntimeError(f"re-planned rank_to_gpu={list(plan.rank_to_gpu)} but the control "
                           f"process decided {d['rank_to_gpu']} (same code and config?)")
    rank = list(plan.rank_to_gpu).index(gpu)
    from . import backend

    backend.join(link.store, gen=link.gen, rank=rank, world=plan.world_size,
                 backend="nccl" if device is not None and device.type == "cuda" else "gloo",
                 timeout_s=link.timeout_s)
    session = build(job, plan, device)
    rank_map = _rank_map(old_plan, plan, d)
    stats = move(None, session, old_plan=old_plan, rank_map=rank_map,
                 joiners=frozenset(d["joiners"]))
    ledger, rng = _share(d, rank_map, None, torch.get_rng_state())
    torch.set_rng_state(rng)
    return _start(job, plan, session, d, link, ledger, stats, device=device, make_run=make_run)
