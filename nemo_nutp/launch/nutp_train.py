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
import os
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape


def _launcher_env() -> tuple[int, int, int] | None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def preflight(cfg: Any) -> None:
    """Checks done before any process or group exists: what the runtime cannot train yet; the
    data path opens and fits the vocabulary; a checkpoint to resume from matches the model."""
    if cfg.parallel.pp != 1:
        raise ValueError(f"parallel.pp={cfg.parallel.pp}: the NUTP training runtime supports "
                         "pp=1 for now (nutp plan / nutp sbatch plan any pp)")
    if cfg.train.data_path:
        from ..data.indexed import IndexedTokenSource

        IndexedTokenSource(cfg.train.data_path, vocab_size=cfg.model.vocab_size,
                           seq_length=cfg.model.seq_length)
    root = cfg.checkpoint_dir
    if root is not None and cfg.checkpoint.resume:
        from ..checkpoint.store import check_compatible, find_latest, read_marker

        latest = find_latest(root)
        marker = read_marker(latest) if latest is not None else None
        if latest is not None and marker is not None:
            check_compatible(marker, cfg.model, latest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nutp-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*",
                    help="Hydra overrides, e.g. nutp.replicas=[4,3] or recipe=llama3_8b_h100")
    ap.add_argument("--config-name", default="config", help="primary config in configs/")
    args = ap.parse_args(argv)
    console = Console()
    from ..config import plan_request
    from ..config.recipes import load_job
    from ..layout import build_plan

    env = _launcher_env()
    try:
        cfg = load_job(args.overrides, config_name=args.config_name)
        under_recovery = env is not None and cfg.recovery.enabled
        slot = -1
        if under_recovery:  # one worker per GPU slot; each attempt re-plans (recovery/elastic.py)
            assert env is not None
            from ..recovery import elastic

            elastic.check_world(cfg, env[1])
            slot = elastic.gpu_slot(dict(os.environ), env[1], env[2], cfg.cluster.gpus_per_node)
        plan = build_plan(plan_request(cfg, world_size=None if env is None or under_recovery
                                       else env[1]))
        preflight(cfg)
    except ValueError as e:  # one line, whatever the width; the message is not markup
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 2
    if env is not None and under_recovery:
        from ..recovery import elastic

        attempt = elastic.attempt_number(dict(os.environ))
        return elastic.run_worker(
            cfg, elastic.LauncherEnv(env[0], env[1], env[2], attempt, slot), console)
    if env is None or env[0] == 0:
        from .plan_report import replicas_table

        console.print(replicas_table(plan))
    if env is not None:
        from ..train.worker import run_rank

        run_rank(env[0], env[1], env[2], cfg, plan, None)
        return 0
    if cfg.recovery.enabled:  # restart at reduced TP on failure (see recovery/supervisor.py)
        from ..recovery.supervisor import supervise

        return supervise(cfg, console)
    import torch.multiprocessing as mp

    from ..launch.ports import free_port
    from ..train.worker import spawned

    mp.spawn(spawned, args=(plan.world_size, cfg, plan, free_port()), nprocs=plan.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
