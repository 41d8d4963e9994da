"""Spawned bodies of the distributed-optimizer tests (``test_zero.py``)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def _session(case: Any, *, distributed: bool) -> Any:
    from nemo_nutp.train.session import Precision, build_session
    from nemo_nutp.train.step import StepOptions
    from tests.helpers.parity import make_plan

    plan = make_plan(case)
    return build_session(
        plan, plan.request.model, lr=case.lr, seed=case.seed, optimizer=case.optimizer,
        micro_batch_size=case.micro_batch_size, bucket_size=case.bucket_size,
        opts=StepOptions(clip_grad=case.clip_grad),
        precision=Precision(case.precision, initial_loss_scale=case.initial_loss_scale),
        distributed_optimizer=distributed, live_redundancy=case.zero_redundancy)


def _local_numel(session: Any) -> int:
    return sum(p.numel() for p in session.model.parameters() if p.requires_grad)


def _no_allgather(opt: Any) -> None:
    """Negative control: each bucket holds only this rank's updated slice (the others' slices
    keep zeros), as if the parameter all-gather were skipped."""
    def local_only(flats: Any, dtype: Any) -> Any:  # the step's bucket-by-bucket gather
        for i, b in enumerate(opt.engine.buckets):
            buf = torch.zeros(b.spec.numel, dtype=dtype)
            for s in opt.segments:
                if s.bucket == i:
                    buf[s.a:s.z] = flats[s.group][s.offset:s.offset + s.z - s.a]
            yield i, buf

    opt._gathered = local_only


class _NoGradHook:
    """The session, minus the harness's gradient hook: with the reduce-scatter no rank holds
    the reduced gradient of its local units (nothing to assemble at the gradient level; the
    norm, the losses and the parameters are compared)."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def step(self, step: int, *, after_sync: Any = None) -> Any:
        del after_sync
        return self.session.step(step)


def run_case(case: Any, outdir: str) -> None:
    """The parity harness's training and comparison, with ``train.distributed_optimizer``;
    also this rank's optimizer-state bytes next to its local parameter count."""
    import torch.distributed as dist

    from tests.helpers.parity import _compare, _no_global_groups, _train

    session = _session(case, distributed=True)
    if case.control == "no_allgather":
        _no_allgather(session.optimizer)
    scatter = session.optimizer.scatter
    got = _train(case, _NoGradHook(session) if scatter else session)
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, (session.optimizer.state_bytes(), _local_numel(session)))
    # redundancy: every copy equals its primary bit for bit after the steps (0.0), while
    # each copy was only ever updated on its own rank (from the ring's gradient chunks)
    worst = torch.tensor([session.optimizer.check_backups()], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        ref = torch.load(os.path.join(outdir, f"ref_{case.name}.pt"))
        result = _compare(case, got, ref)
        result.update(shares=[r.microbatches for r in session.plan.replicas],
                      state=stats, replicas=len(session.plan.replicas),
                      backup_diff=float(worst), redundancy=case.zero_redundancy,
                      global_tp_group_untouched=_no_global_groups(),
                      grads_compared=not scatter)
        with open(os.path.join(outdir, f"{case.name}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def parity_worker(rank: int, world: int, port: int, cases: list[Any], outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        for case in cases:
            run_case(case, outdir)

    gloo_rank(rank, world, port, outdir, body)
