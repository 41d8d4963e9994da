"""Round-trip harness: save in one layout after 3 steps, load in another, train 2 more steps.

One spawned world per world size runs a list of ``Job``s in order; each job builds a session for
its layout and either trains ``fresh`` steps and saves, loads checkpoints of other layouts and
trains on, or (TP1 only) records the uninterrupted reference losses. Results are JSON files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SAVE_AT = 3
AFTER = 2
MODEL = dict(add_bias_linear=True)  # tiny: GQA 8 heads / 4 groups, SwiGLU, vocab 101, + biases


@dataclass(frozen=True)
class Job:
    layout: str  # name, e.g. "tp4_tp3"
    replicas: tuple[Any, ...]  # a degree per replica, or (pp > 1) per replica per stage
    load: tuple[str, ...] = ()  # layouts whose checkpoints to load (each: 2 steps after)
    save: bool = False  # train SAVE_AT steps from scratch and save
    reference: bool = False  # train SAVE_AT + AFTER steps uninterrupted
    extra: dict[str, Any] = field(default_factory=dict)  # precision, clip_grad, model,
    # distributed_optimizer, async_save
    pp: int = 1
    vp: int = 1  # virtual pipeline stages (model chunks per rank)


def make_plan(replicas: tuple[Any, ...], *, pp: int = 1, vp: int = 1,
              model: dict[str, Any] | None = None) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    tb = max(max(r) if isinstance(r, tuple) else r for r in replicas)
    n = tb * pp * len(replicas)
    req = PlanRequest(cluster=ClusterSpec(num_gpus=n, domain_size=tb, gpus_per_node=tb),
                      model=ModelConfig(**(MODEL if model is None else model)),
                      parallel=ParallelSpec(tp_base=tb, pp=pp,
                                            virtual_pipeline_model_parallel_size=vp),
                      replicas=replicas,
                      global_batch=8)
    return build_plan(req)


def _session(job: Job) -> Any:
    from nemo_nutp.train.schedule import Schedule
    from nemo_nutp.train.session import Precision, build_session
    from nemo_nutp.train.step import StepOptions

    plan = make_plan(job.replicas, pp=job.pp, vp=job.vp, model=job.extra.get("model"))
    # warmup + cosine: the schedule continues across a save and a load into any layout
    schedule = Schedule(lr=1e-3, min_lr=1e-4, warmup_iters=2, warmup_init=1e-4,
                        decay_style="cosine", decay_iters=SAVE_AT + AFTER)
    return build_session(plan, plan.request.model, lr=1e-3, seed=1234, micro_batch_size=2,
                         schedule=schedule,
                         precision=Precision(job.extra.get("precision", "fp32")),
                         opts=StepOptions(clip_grad=job.extra.get("clip_grad", 0.0)),
                         distributed_optimizer=job.extra.get("distributed_optimizer", False))


def save(s: Any, root: str, step: int, *, background: bool,
         during: Any = None) -> dict[str, Any]:
    """``save_checkpoint``; with ``background`` an asynchronous save: ``during()`` (e.g. a
    training step that changes every parameter) runs while the write is in flight, and the
    loader must not see the checkpoint before it completes. Returns what was checked."""
    from nemo_nutp.checkpoint import find_latest, save_checkpoint
    from nemo_nutp.checkpoint.background import BackgroundSaves

    if not background:
        save_checkpoint(s, root, step=step)
        return {}
    before = find_latest(root) if os.path.isdir(root) else None
    saves = BackgroundSaves()
    final = save_checkpoint(s, root, step=step, background=saves)
    assert saves.pending is not None
    invisible = not final.exists() and find_latest(root) == before  # in flight: not loadable
    if during is not None:
        during()
    saves.wait()
    assert saves.pending is None
    done = final.is_dir() and find_latest(root) == final
    return {"async_invisible_in_flight": _all(invisible), "async_complete": _all(done),
            "async_snapshot_bytes": saves_max(saves)}


def saves_max(saves: Any) -> int:
    from nemo_nutp.checkpoint.background import host_snapshot_bytes_all

    return host_snapshot_bytes_all(saves.last_snapshot_bytes)


def run_job(job: Job, outdir: str, index: str) -> None:
    import torch
    import torch.distributed as dist

    from nemo_nutp.checkpoint import load_checkpoint, save_checkpoint

    rank0 = dist.get_rank() == 0
    res: dict[str, Any] = {}
    if job.reference:
        s = _session(job)
        res["reference"] = [s.step(k).loss for k in range(SAVE_AT + AFTER)]
    for src in job.load:
        s = _session(job)  # fresh weights: everything must come from the checkpoint
        info = load_checkpoint(s, os.path.join(outdir, f"ckpt_{src}", f"iter_{SAVE_AT:07d}"))
        assert info["step"] == SAVE_AT, info["step"]
        # Another plan: every rank gets the saving run's rank 0 CPU state.
        assert info["rng"] == "rank 0", info["rng"]
        res[f"rng_from_{src}"] = _all(torch.equal(torch.get_rng_state(),
                                                  _seeded_state(1000)))
        res[f"from_{src}"] = [s.step(k).loss for k in range(SAVE_AT, SAVE_AT + AFTER)]
    if job.save:
        s = _session(job)
        res["fresh"] = [s.step(k).loss for k in range(SAVE_AT)]
        torch.manual_seed(1000 + dist.get_rank())  # per-rank RNG states differ
        saved_rng = torch.get_rng_state()
        # With async_save: a step runs while the write is in flight (every parameter and Adam
        # state changes); the checkpoint must hold the state at the save.
        res.update(save(s, os.path.join(outdir, f"ckpt_{job.layout}"), SAVE_AT,
                        background=job.extra.get("async_save", False),
                        during=lambda: s.step(SAVE_AT)))
        torch.manual_seed(0)
        # Self round trip in the same session object: load over the trained state.
        info = load_checkpoint(s, os.path.join(outdir, f"ckpt_{job.layout}",
                                               f"iter_{SAVE_AT:07d}"))
        # Same plan: every rank gets its own RNG state back.
        res["self_rng"] = [info["rng"], _all(torch.equal(torch.get_rng_state(), saved_rng))]
        res["self"] = [s.step(k).loss for k in range(SAVE_AT, SAVE_AT + AFTER)]
        # fp32 skips no step: a skip count the checkpoint must carry (the schedule's clock)
        s.skips = 2
        save_checkpoint(s, os.path.join(outdir, f"skips_{job.layout}"), step=SAVE_AT)
        s.skips = 0
        load_checkpoint(s, os.path.join(outdir, f"skips_{job.layout}", f"iter_{SAVE_AT:07d}"))
        res["self_skips"] = s.skips
    if rank0:
        with open(os.path.join(outdir, f"{job.layout}@{index}.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()


def _all(flag: bool) -> bool:
    """``flag`` holds on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _seeded_state(seed: int) -> Any:
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return g.get_state()


def worker(rank: int, world: int, port: int, jobs: list[Job], outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        for k, job in enumerate(jobs):
            run_job(job, outdir, f"{world}.{port}.{k}")

    gloo_rank(rank, world, port, outdir, body)
