"""The training loop's side of a live re-layout (``recovery.mode=live``): arm a run's
session with the commit vote and the phase faults, and turn a stopped world into the next
one in the same process (``live.py`` has the protocol, ``commit.py`` its invariants)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .commit import renumber, replan
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
    if inj is not None:
        inj.arm(session, lambda: (link.step, link.gen))


def _apply(old: Any, link: LiveRank, step: int) -> None:
    """Complete the committed step from the gradients this rank holds (voted, result lost)."""
    from ..train.step import optimizer_step

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


def _digest(session: Any, gen: int) -> None:
    """``NUTP_LIVE_DIGEST=1`` (tests): rank 0 logs a digest of every replica's assembled global
    parameters (``live_digest``); replicas are bitwise equal iff their digests are."""
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
        log_event("live_digest", gen=gen, replica=i, digest=h.hexdigest())


def relayout(cfg: Any, run: Any, link: LiveRank, error: BaseException, *,
             device: torch.device | None, make_run: Any, build: Any) -> tuple[Any, int]:
    """The world this rank trained in stopped (``error``): report, follow the control
    process's decision, join the next world with the state moved. Returns the new run and
    the step it starts at (last committed + 1)."""
    from .decisions import job_for

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
    job = job_for(cfg, frozenset(d["failed_gpus"]))
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
    rank_map = {o: n for o, n in renumber(tuple(old.plan.rank_to_gpu),
                                          tuple(plan.rank_to_gpu)).items()
                if n is not None and o not in d["dead_ranks"]}
    stats = move(old, session, rank_map=rank_map)
    del old
    run.session = None
    torch.set_rng_state(rng)
    ledger = run.ledger
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
    if rank == 0:
        link.post("started", {"t": time.time(), "bytes_received_rank_max": int(mx[0]),
                              "lower_bound_rank_max": int(mx[1]), "peak_memory_ratio": mx[2],
                              "move_s": mx[3], "resume_step": start})
    return new, start
