"""``nutp-bridge``: a Megatron-Bridge recipe with NUTP, trained by Bridge's own ``train()``.

    nutp-bridge --recipe megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config \\
        --config-file overrides.yaml model.tensor_model_parallel_size=2 nutp.replicas=[2,1]

Run as ``python nemo_nutp/launch/bridge_cli.py`` or ``python -m
nemo_nutp.launch.bridge_cli``. Overrides and NUTP keys: ``bridge_config``. Plain
invocation spawns the plan's world on this machine (gloo, CPU); under ``torchrun``
(``RANK``/``WORLD_SIZE``) this process is one rank (NCCL when CUDA is present). Everything is
validated and planned before any process group.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nutp-bridge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="module:function returning a ConfigContainer")
    ap.add_argument("--config-file", default=None, help="YAML overrides (Bridge keys + nutp:)")
    ap.add_argument("--output-dir", default=None,
                    help="another name for output.dir (default runs/bridge): metrics.jsonl, "
                         "goodput.json, training.png, per-rank step records")
    ap.add_argument("overrides", nargs="*", help="a.b=c (Bridge keys, or nutp.*/failures.*/"
                                                  "cluster.*/output.*/recovery.*)")
    return ap


def _load(argv: list[str]) -> tuple[Any, Any, Any]:
    from nemo_nutp.config import plan_request
    from nemo_nutp.integrations.bridge_config import load_bridge_job
    from nemo_nutp.layout import build_plan

    args = _parser().parse_intermixed_args(argv)
    job = load_bridge_job(args.recipe, args.config_file, args.overrides,
                          output_dir=args.output_dir)
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
    print_notices(job.bridge)
    os.makedirs(job.nutp.output.dir, exist_ok=True)
    import torch

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, argv, backend)
        return 0
    import torch.multiprocessing as mp

    from nemo_nutp.common.ports import free_port

    mp.spawn(_rank, args=(plan.world_size, free_port(), argv, "gloo"), nprocs=plan.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
