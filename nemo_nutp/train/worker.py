"""One training rank: join the process group (NCCL on GPU, gloo on CPU) and train.

Used by every way a rank starts: ``nutp-train``'s local spawn, a launcher (``torchrun``/``srun``)
and the recovery supervisor's forked ranks.
"""

from __future__ import annotations

import os
import warnings
from typing import Any


def run_rank(rank: int, world: int, local_rank: int, cfg: Any, plan: Any,
              port: int | None) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = None
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        from ..compat.cpu import apply_cpu_patches

        apply_cpu_patches()
        torch.set_num_threads(1)
        backend = "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        from .loop import train_rank

        train_rank(cfg, plan, device=device)
    finally:
        dist.destroy_process_group()


def spawned(rank: int, world: int, cfg: Any, plan: Any, port: int) -> None:
    run_rank(rank, world, rank, cfg, plan, port)
