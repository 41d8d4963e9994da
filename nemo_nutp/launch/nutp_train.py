"""``nutp-train`` / ``python -m nemo_nutp.train``: the main job.

* Plain invocation (no ``RANK`` in the environment): plan the job, print the plan, and spawn the
  plan's world on this machine with gloo (CPU), one process per rank.
* Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) or ``srun`` (``SLURM_PROCID``/
  ``SLURM_NTASKS``/``SLURM_LOCALID`` plus ``MASTER_ADDR``/``MASTER_PORT``): use the launcher's
  ranks, NCCL and ``cuda:LOCAL_RANK`` when CUDA is present (gloo/CPU otherwise).

The configuration is validated and the plan built *before* any process group exists.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from ..common.console import make_console, print_error

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan


def _launcher_env() -> tuple[int, int, int] | None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def check_launch(cfg: JobConfig, plan: Plan, env: tuple[int, int, int], environ: dict[str, str]
                 ) -> None:
    """Under a plain ``torchrun``/``srun`` (no recovery) the launcher's rank is the plan rank
    and ``cuda:LOCAL_RANK`` its GPU: refuse (one line, before any process group) unless the
    plan puts this rank on this worker's GPU slot (node index x gpus_per_node + local rank,
    ``train.elastic.gpu_slot``), so a degraded TP group never straddles nodes or lands on
    a failed GPU."""
    from ..train.elastic import gpu_slot

    rank, world, local = env
    if world != plan.world_size:
        raise ValueError(f"WORLD_SIZE={world}: the plan has {plan.world_size} ranks (launch "
                         "one worker per planned GPU, or set recovery.enabled=true to map "
                         "workers to GPU slots)")
    slot = gpu_slot(environ, world, local, cfg.cluster.gpus_per_node)
    planned = int(plan.rank_to_gpu[rank])
    if planned != slot:
        failed = sorted(plan.request.health.failed_gpus)
        raise ValueError(f"RANK={rank}: this worker drives GPU slot {slot} but the plan puts "
                         f"rank {rank} on GPU {planned} (failed GPUs {failed}); launch the "
                         "workers on the planned GPUs, or set recovery.enabled=true to map "
                         "them by GPU slot")


def preflight(cfg: JobConfig, plan: Plan | None = None) -> None:
    """Checks done before any process or group exists: what the runtime cannot train yet; the
    data path opens and fits the vocabulary; a checkpoint to resume from matches the model;
    where results and checkpoints go can be created and written."""
    check_inputs(cfg, plan)
    from ..checkpoint.hooks import check_output_dirs

    check_output_dirs(cfg)


def check_inputs(cfg: JobConfig, plan: Plan | None = None) -> None:
    """The part of ``preflight`` a dry run does too: combinations no runtime can run, the data
    path, the checkpoint to resume from (``plan``: fault injection must name a planned rank)."""
    rec = cfg.recovery
    faults = [("recovery.fault", rec.fault),
              *((f"recovery.faults[{i}]", f) for i, f in enumerate(rec.faults))]
    if plan is not None and cfg.recovery.live_redundancy and len(plan.replicas) < 2:
        raise ValueError(f"recovery.live_redundancy=true: the plan has {len(plan.replicas)} "
                         "replica; the copy of an optimizer slice needs another replica's rank")
    for key, fault in faults:
        if fault.kind is None:
            continue
        if plan is not None and fault.rank >= plan.world_size:
            raise ValueError(f"{key}.rank={fault.rank}: the plan has {plan.world_size} "
                             f"ranks (0..{plan.world_size - 1})")
        if fault.phase is not None and rec.mode != "live":
            raise ValueError(f"{key}.phase={fault.phase!r}: a phase fault fires under "
                             "recovery.mode=live only")
    from ..data.indexed import IndexedTokenSource

    for key in ("data_path", "valid_data_path"):
        if getattr(cfg.train, key):
            IndexedTokenSource(getattr(cfg.train, key), vocab_size=cfg.model.vocab_size,
                               seq_length=cfg.model.seq_length, key=f"train.{key}")

    from ..checkpoint.hooks import resume_candidates
    from ..checkpoint.store import check_compatible, check_dims_of_megatron_checkpoint, read_marker

    found = resume_candidates(cfg)  # a given path with nothing loadable: ValueError naming it
    marker = read_marker(found[0]) if found else None
    if marker is not None:
        check_compatible(marker, cfg.model, found[0])
    elif found:  # e.g. a stock megatron-core checkpoint
        check_dims_of_megatron_checkpoint(found[0], cfg.model)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nutp-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*",
                    help="Hydra overrides, e.g. nutp.replicas=[4,3] or recipe=llama3_8b_h100")
    ap.add_argument("--config-name", default="config", help="primary config in configs/")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate, plan and print the plan (per-stage degrees and predicted "
                         "times); spawn nothing, exit 0 (2 on a bad config)")
    args = ap.parse_intermixed_args(argv)  # overrides may follow --dry-run
    from ..common.quiet import quiet_optional_kernel_notes

    quiet_optional_kernel_notes()
    console = make_console()
    from ..config import plan_request
    from ..config.recipes import load_job
    from ..layout import build_plan

    env = _launcher_env()
    if args.dry_run:
        return _dry_run(args, console)
    try:
        cfg = load_job(args.overrides, config_name=args.config_name)
        under_recovery = env is not None and cfg.recovery.enabled
        slot = -1
        if under_recovery:  # one worker per GPU slot; each attempt re-plans (train/elastic.py)
            assert env is not None
            from ..train import elastic

            elastic.check_world(cfg, env[1])
            slot = elastic.gpu_slot(dict(os.environ), env[1], env[2], cfg.cluster.gpus_per_node)
        plan = build_plan(plan_request(cfg, world_size=None if env is None or under_recovery
                                       else env[1]))
        if env is not None and not under_recovery:
            check_launch(cfg, plan, env, dict(os.environ))
        preflight(cfg, plan)
        lock = _lock_for(cfg, env)
    except ValueError as e:  # one line, whatever the width; the message is not markup
        print_error(str(e))
        return 2
    try:
        return _run(cfg, plan, env, slot, console)
    finally:
        if lock is not None:
            lock.release()


def _dry_run(args: argparse.Namespace, console: Any) -> int:
    """Validate and plan as a launch would, print the plan; no process, lock or file. The
    runtime's own limits (``preflight``'s first checks) are not applied: a plan of any layout
    prints."""
    from ..common.plan_report import memory_table, replicas_table
    from ..config import plan_request
    from ..config.recipes import load_job
    from ..layout import build_plan

    try:
        cfg = load_job(args.overrides, config_name=args.config_name)
        plan = build_plan(plan_request(cfg))
        check_inputs(cfg, plan)
    except ValueError as e:
        print_error(str(e))
        return 2
    c = cfg.cluster
    console.print(f"[bold]{c.name}[/]: {c.num_gpus} GPUs, domains of {c.domain_size}, "
                  f"{len(plan.request.health.failed_gpus)} failed; parallel.pp={plan.pp}, "
                  f"parallel.tp_base={cfg.parallel.tp_base}")
    console.print(replicas_table(plan))
    mem = memory_table(plan)
    console.print(mem if mem is not None else "memory: not estimated (the cluster's hardware "
                  "file has no gpu_memory_gib)")
    console.print(f"dry run: {plan.world_size} ranks planned, nothing spawned")
    return 0


def _lock_for(cfg: JobConfig, env: tuple[int, int, int] | None) -> Any:
    """The output directory's lock, taken by the process that owns the run's outputs: the
    local launcher, or rank 0 (worker slot 0 under recovery) of an external launcher."""
    if env is not None and env[0] != 0:
        return None
    from ..common.output_lock import OutputLock

    return OutputLock(cfg.output.dir).acquire()


def _run(cfg: JobConfig, plan: Plan, env: tuple[int, int, int] | None, slot: int,
         console: Any) -> int:
    under_recovery = env is not None and cfg.recovery.enabled
    if under_recovery:
        assert env is not None
        from ..train import elastic

        attempt = elastic.attempt_number(dict(os.environ))
        return elastic.run_worker(
            cfg, elastic.LauncherEnv(env[0], env[1], env[2], attempt, slot), console)
    if env is None or env[0] == 0:
        from ..common.plan_report import replicas_table

        console.print(replicas_table(plan))
    if env is not None:
        from ..train.worker import run_rank

        run_rank(env[0], env[1], env[2], cfg, plan, None)
        return 0
    if cfg.recovery.enabled:  # restart at reduced TP on failure (see recovery/supervisor.py)
        from ..recovery.supervisor import supervise

        return supervise(cfg, console)
    return _spawn_local(cfg, plan)


def _spawn_local(cfg: JobConfig, plan: Plan) -> int:
    """The plan's world as local processes; a rank's error is one line (``train/worker.py``)."""
    import time

    import torch.multiprocessing as mp

    from ..common.env import PARENT_REPORTS
    from ..common.ports import free_port
    from ..train.worker import first_error, spawned
    from .local import start_ranks

    os.environ[PARENT_REPORTS] = "1"
    # torch logs one "Terminating process ... via signal SIGTERM" per surviving rank when one
    # fails: noise around the one line that says why
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    since = time.time()
    try:
        start_ranks(spawned, (plan.world_size, cfg, plan, free_port()), plan.world_size)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        rec = first_error(cfg.output.dir, since)
        if rec is None:
            print_error(f"rank {e.error_index} failed: {' '.join(str(e).split())[:300]}")
            return 1
        print_error(f"rank {rec['rank']}: {rec['message']} (details: {rec['log']})")
        return int(rec["code"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
