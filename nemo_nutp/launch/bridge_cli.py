"""``nutp-bridge``: a Megatron-Bridge recipe with NUTP, trained by Bridge's own ``train()``.

    nutp-bridge --recipe megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config \\
        --config-file overrides.yaml model.tensor_model_parallel_size=2 nutp.replicas=[2,1]

Run as ``python nemo_nutp/launch/bridge_cli.py`` or ``python -m
nemo_nutp.launch.bridge_cli``. Overrides and NUTP keys: ``bridge_config``. Plain
invocation spawns the plan's world on this machine (gloo, CPU); under ``torchrun``
(``RANK``/``WORLD_SIZE``) this process is one rank (NCCL when CUDA is present). Everything is
validated and planned before any process group.

``recovery.enabled=true`` (``recovery.mode=restart``): the plain invocation runs the ranks under
``nutp-train``'s recovery supervisor (``recovery/supervisor.py``): a rank killed or hung ends the
world, its GPU is marked failed, the job is re-planned and relaunched, and the new world resumes
inside Bridge's ``train()`` from the newest checkpoint under ``checkpoint.save`` (Bridge's
``checkpoint.load`` pointed at it: ``integrations/bridge_recovery.py``). Events, summary and
heartbeats go to ``<output.dir>/recovery/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..common.env import ATTEMPT, DEBUG, HEARTBEAT_DIR


def _rank(rank: int, world: int, port: int, argv: list[str], backend: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.compat.bridge_cpu import apply_bridge_cpu_patches

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port:
        os.environ["MASTER_PORT"] = str(port)
    apply_bridge_cpu_patches()
    dist.init_process_group(backend, rank=rank, world_size=world)
    _, job, plan = _load(argv)
    from nemo_nutp.integrations.bridge_run import train_rank

    train_rank(job, plan, job.nutp.output.dir, seed=job.nutp.train.seed)
    dist.destroy_process_group()


def recovery_rank(argv: list[str], rank: int, world: int, job: Any, plan: Any, port: int,
                  env: dict[str, str]) -> None:
    """One rank the recovery supervisor starts (``recovery.world.RankEntry``): the Bridge job
    from ``argv`` with the supervisor's NUTP job of this attempt (its failed GPUs) and plan; a
    relaunch reads the newest checkpoint under ``checkpoint.save``. An error ends the rank as a
    ``nutp-train`` rank's does (``train/worker.py``: one record, exit 2 for bad input, else 1)."""
    from nemo_nutp.health import watch
    from nemo_nutp.recovery.world import enter

    enter(env)
    watch.start_stack_watcher(Path(env[HEARTBEAT_DIR]) / f"rank{rank}.stack")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        from nemo_nutp.compat.bridge_cpu import apply_bridge_cpu_patches
        from nemo_nutp.integrations.bridge_recovery import resume_at_save
        from nemo_nutp.integrations.bridge_run import train_rank

        apply_bridge_cpu_patches()
        _, bridge_job = _job(argv)
        bridge_job.nutp = job
        resume_at_save(bridge_job.bridge, int(env.get(ATTEMPT, "0")))
        if job.recovery.mode == "live":  # world 0 on the live control process's store
            from nemo_nutp.integrations.bridge_live import train_rank_live
            from nemo_nutp.train.worker import live_link

            link = live_link(rank, world, "gloo", job)
            train_rank_live(bridge_job, plan, job.output.dir, seed=job.train.seed, link=link)
            _exit(0)  # abandoned worlds' groups are kept alive (live/backend.py)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        train_rank(bridge_job, plan, job.output.dir, seed=job.train.seed)
        dist.destroy_process_group()
    except Exception as e:
        _failed(job, rank, e)


def join_rank(argv: list[str], slot: int, job: Any, old_plan: Any, gpu: int, gen: int,
              env: dict[str, str]) -> None:
    """A returning GPU's process under ``recovery.mode=live`` (grow back), started by the live
    control process (``recovery.world.RankEntry.join``): joins world ``gen`` of the running
    Bridge job with the state moved from the survivors."""
    from nemo_nutp.recovery.world import enter

    enter(env)
    try:
        from nemo_nutp.compat.bridge_cpu import apply_bridge_cpu_patches
        from nemo_nutp.integrations.bridge_live import train_rank_live
        from nemo_nutp.live.link import LiveRank, control_address

        apply_bridge_cpu_patches()
        _, bridge_job = _job(argv)
        bridge_job.nutp = job
        addr = control_address()
        assert addr is not None, "a joiner is started by the live control process"
        link = LiveRank(addr[0], addr[1], slot=slot, timeout_s=job.recovery.startup_timeout_s)
        link.start(gen=gen, cfg=job)
        train_rank_live(bridge_job, old_plan, job.output.dir, seed=job.train.seed, link=link,
                        joining=gpu)
        _exit(0)
    except Exception as e:
        _failed(job, slot, e)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _failed(job: Any, rank: int, e: Exception) -> None:
    """An error ends the rank as a ``nutp-train`` rank's does (one record; exit 2 for bad
    input, else 1; ``NUTP_DEBUG=1``: raise)."""
    if os.environ.get(DEBUG) == "1":
        raise e
    from nemo_nutp.train.worker import report_error

    _exit(report_error(job.output.dir, rank, e))


BRIDGE_PRELOAD = ("nemo_nutp.integrations.bridge_preload", "nemo_nutp.health.watch",
                  "nemo_nutp.recovery.world", "nemo_nutp.train.worker")
"""Imported once by the supervisor's fork server: Bridge and the NUTP modules its ranks run."""


def _supervise(job: Any, argv: list[str]) -> int:
    """``recovery.enabled=true``: the world under the recovery supervisor (module docstring)."""
    from functools import partial

    from nemo_nutp.common.console import make_console
    from nemo_nutp.launch import bridge_cli  # by its module name, also when run as __main__
    from nemo_nutp.recovery.supervisor import supervise
    from nemo_nutp.recovery.world import RankEntry

    cfg = job.nutp  # output.dir: --output-dir's too
    entry = RankEntry(partial(bridge_cli.recovery_rank, argv), BRIDGE_PRELOAD,
                      partial(bridge_cli.join_rank, argv))
    return supervise(cfg, make_console(), entry=entry)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nutp-bridge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="module:function returning a ConfigContainer")
    ap.add_argument("--config-file", default=None, help="YAML overrides (Bridge keys + nutp:)")
    ap.add_argument("--output-dir", default=None,
                    help="another name for output.dir (default runs/bridge): metrics.jsonl, "
                         "goodput.json, training.png, per-rank step records")
    ap.add_argument("overrides", nargs="*", help="a.b=c (Bridge keys, or nutp.*/health.*/"
                                                  "cluster.*/output.*/recovery.*)")
    return ap


def _job(argv: list[str]) -> tuple[Any, Any]:
    from nemo_nutp.integrations.bridge_config import load_bridge_job

    args = _parser().parse_intermixed_args(argv)
    return args, load_bridge_job(args.recipe, args.config_file, args.overrides,
                                 output_dir=args.output_dir)


def _load(argv: list[str]) -> tuple[Any, Any, Any]:
    from nemo_nutp.config import plan_request
    from nemo_nutp.layout import build_plan

    args, job = _job(argv)
    plan = build_plan(plan_request(job.nutp))
    return args, job, plan


def print_notices(cfg: Any) -> None:
    """The one-line notice of every substituted setting (``bridge_fields.SUBSTITUTED``), once:
    by the launching process, or by rank 0 under ``torchrun``."""
    from nemo_nutp.common.console import print_notice
    from nemo_nutp.integrations.bridge_fields import notices

    if os.environ.get("RANK", "0") == "0":
        for line in notices(cfg):
            print_notice(line)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from nemo_nutp.common.console import print_error

    try:
        _, job, plan = _load(argv)
    except ValueError as e:
        print_error(str(e))
        return 2
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched and job.nutp.recovery.enabled:
        print_error("recovery.enabled=true: nutp-bridge recovers the world it spawns itself; "
                    "under torchrun that is not built yet (run it without torchrun, or set "
                    "recovery.enabled=false)")
        return 2
    print_notices(job.bridge)
    os.makedirs(job.nutp.output.dir, exist_ok=True)
    if job.nutp.recovery.enabled:
        return _supervise(job, argv)
    import torch

    if launched:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, argv, backend)
        return 0
    import torch.multiprocessing as mp

    from nemo_nutp.common.ports import free_port

    mp.spawn(_rank, args=(plan.world_size, free_port(), argv, "gloo"), nprocs=plan.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
