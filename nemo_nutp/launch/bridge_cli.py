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

On a Slurm cluster (docs/cluster.md): ``nutp-bridge sbatch <the job's arguments> [--out
job.sbatch --partition ... --image ...]`` renders the batch script ``nutp sbatch`` renders
(``launch/slurm.py``, the same options) with Bridge ranks: the recipe, config file and
overrides carried verbatim. ``recovery.mode=restart``: each srun task is a recovery worker
(``train/elastic.py``, the srun loop restarts the attempt; here under ``srun``/``torchrun``
with ``recovery.enabled=true``); ``recovery.mode=live``: ``nutp-bridge control`` (the live
control process, ``launch/control.py``) and one node agent per node, which start Bridge's
ranks (``bridge_entry``).
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
                  env: dict[str, str], local: int | None = None) -> None:
    """One rank the recovery supervisor (or a node agent) starts (``recovery.world.RankEntry``):
    the Bridge job from ``argv`` with the supervisor's NUTP job of this attempt (its failed
    GPUs) and plan; a relaunch reads the newest checkpoint under ``checkpoint.save``. ``local``:
    its device on its node (a node agent's rank; ``LOCAL_RANK``). An error ends the rank as a
    ``nutp-train`` rank's does (``train/worker.py``: one record, exit 2 for bad input, else 1)."""
    from nemo_nutp.health import watch
    from nemo_nutp.recovery.world import enter

    enter(env)
    if local is not None:
        os.environ["LOCAL_RANK"] = str(local)
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


def bridge_entry(argv: list[str]) -> Any:
    """What a rank and a returning GPU's process of ``argv``'s job run
    (``recovery.world.RankEntry``): ``recovery_rank``/``join_rank`` on ``BRIDGE_PRELOAD``. The
    one place it is made: the supervisor's fork server starts it on this machine, and a Slurm
    job's node agents get it, pickled, from ``nutp-bridge control`` (``recovery/agent.py``)."""
    from functools import partial

    from nemo_nutp.launch import bridge_cli  # by its module name, also when run as __main__
    from nemo_nutp.recovery.world import RankEntry

    return RankEntry(partial(bridge_cli.recovery_rank, argv), BRIDGE_PRELOAD,
                     partial(bridge_cli.join_rank, argv))


def _supervise(job: Any, argv: list[str]) -> int:
    """``recovery.enabled=true``: the world under the recovery supervisor (module docstring)."""
    from nemo_nutp.common.console import make_console
    from nemo_nutp.recovery.supervisor import supervise

    cfg = job.nutp  # output.dir: --output-dir's too
    return supervise(cfg, make_console(), entry=bridge_entry(argv))


def worker_train(argv: list[str], attempt: int, job: Any, plan: Any, *, device: Any,
                 on_checkpoint: Any) -> None:
    """A recovery worker's training under a launcher (``train/elastic.py: run_worker``'s
    ``train``; the srun loop of ``nutp-bridge sbatch``): ``argv``'s Bridge job on the worker's
    NUTP job of this attempt (its failed GPUs) and plan, in the attempt's process group;
    attempt > 0 resumes from the newest checkpoint under ``checkpoint.save``. Bridge's own
    checkpointing saves, so ``on_checkpoint`` (a GPU back found at a save) is left to the
    health watch's own poll (every 0.5 s)."""
    from nemo_nutp.compat.bridge_cpu import apply_bridge_cpu_patches
    from nemo_nutp.integrations.bridge_recovery import resume_at_save
    from nemo_nutp.integrations.bridge_run import train_rank

    apply_bridge_cpu_patches()
    _, bridge_job = _job(argv)
    bridge_job.nutp = job
    resume_at_save(bridge_job.bridge, attempt)
    train_rank(bridge_job, plan, job.output.dir, seed=job.train.seed)


def _worker(job: Any, argv: list[str], slot: int) -> int:
    """``recovery.enabled=true`` under ``srun``/``torchrun``: one recovery worker per GPU slot
    (``train/elastic.py``), each attempt re-planned, Bridge's ``train()`` on the plan's ranks."""
    from functools import partial

    from nemo_nutp.common.console import make_console
    from nemo_nutp.launch import bridge_cli
    from nemo_nutp.train import elastic

    rank, world, local = _launched()
    attempt = elastic.attempt_number(dict(os.environ))
    try:
        code = elastic.run_worker(job.nutp,
                                  elastic.LauncherEnv(rank, world, local, attempt, slot),
                                  make_console(),
                                  train=partial(bridge_cli.worker_train, argv, attempt))
    except SystemExit as e:  # a worker's error: its one line and exit record are written
        code = e.code if isinstance(e.code, int) else 1
    # Leave without the interpreter's teardown: the exit record is written and the attempt's
    # store may close under it (its host, worker 0, leaves last), while a worker that imported
    # Bridge takes seconds to tear down; a store thread failing inside it aborts the process
    # (SIGABRT, 134 -- the srun loop would count a finished attempt as failed).
    _exit(code)
    return code


def _launched() -> tuple[int, int, int]:
    env = os.environ
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))


def _control(argv: list[str]) -> int:
    """``nutp-bridge control --listen PORT [--address HOST] <the job's arguments>``: the live
    control process of a Slurm job (``launch/control.py: serve``), its node agents starting
    Bridge's ranks (``bridge_entry``)."""
    from nemo_nutp.common.console import make_console, print_error
    from nemo_nutp.launch import control

    ap = argparse.ArgumentParser(prog="nutp-bridge control", allow_abbrev=False,
                                 description=_control.__doc__)
    ap.add_argument("--listen", type=int, required=True, help="port of the agents' store")
    ap.add_argument("--address", default=None,
                    help="this host as the agents and ranks reach it (default: hostname)")
    args, rest = ap.parse_known_args(argv)
    try:
        _, job, _ = _load(rest)
        control.check_live(job.nutp)
    except ValueError as e:
        print_error(str(e))
        return 2
    print_notices(job.bridge)
    os.makedirs(job.nutp.output.dir, exist_ok=True)
    return control.serve(job.nutp, args.listen, args.address, make_console(),
                         entry=bridge_entry(rest))


def _sbatch(argv: list[str]) -> int:
    """``nutp-bridge sbatch``: the batch script of ``nutp sbatch`` for this Bridge job."""
    from nemo_nutp.common.console import make_console, print_error
    from nemo_nutp.launch import slurm

    ap = argparse.ArgumentParser(prog="nutp-bridge sbatch", description=(
        "Render a Slurm batch script (pyxis container) that runs this Megatron-Bridge recipe "
        "with nutp-bridge: the options of `nutp sbatch`, and the job's arguments as "
        "nutp-bridge takes them, carried verbatim."))
    _job_arguments(ap)
    slurm.add_options(ap)
    args = ap.parse_intermixed_args(argv)
    try:
        job_argv = ["--recipe", args.recipe]
        if args.config_file is not None:  # the ranks run in the image's repo: an absolute path
            path = Path(args.config_file)
            if not path.is_file():
                raise ValueError(f"--config-file={args.config_file}: no such file")
            job_argv += ["--config-file", str(path.resolve())]
        if args.output_dir is not None:
            job_argv += ["--output-dir", args.output_dir]
        job_argv += args.overrides
        command = slurm.bridge_command(job_argv)
        _, job, plan = _load(job_argv)
        cfg = job.nutp
        slurm.check_live_enabled(cfg)
        opts = slurm.options(args)
        text = slurm.render_sbatch(plan, opts, command=command,
                                   recovery=cfg.recovery if cfg.recovery.enabled else None)
    except ValueError as e:
        print_error(str(e))
        return 2
    print_notices(job.bridge)
    slurm.write_script(text, args.out, plan, cfg, opts, make_console())
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nutp-bridge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return _job_arguments(ap)


def _job_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    from nemo_nutp.integrations.bridge_run import moe_spec_of, preflight
    from nemo_nutp.layout import build_plan

    args, job = _job(argv)
    plan = build_plan(plan_request(job.nutp, moe=moe_spec_of(job.bridge.model)))
    preflight(job, plan)
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
    # the sub-commands: an override is a=b, so neither word is one
    if argv[:1] == ["sbatch"]:
        return _sbatch(argv[1:])
    if argv[:1] == ["control"]:
        return _control(argv[1:])
    from nemo_nutp.common.console import print_error

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        _, job, plan = _load(argv)
        worker = launched and job.nutp.recovery.enabled
        if worker:  # one recovery worker per GPU slot (before any process group)
            from nemo_nutp.train import elastic

            _, world, local = _launched()
            elastic.check_world(job.nutp, world)
            slot = elastic.gpu_slot(dict(os.environ), world, local,
                                    job.nutp.cluster.gpus_per_node)
    except ValueError as e:
        print_error(str(e))
        return 2
    print_notices(job.bridge)
    os.makedirs(job.nutp.output.dir, exist_ok=True)
    if worker:
        return _worker(job, argv, slot)
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
