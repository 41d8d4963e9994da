"""One CPU/gloo rank of a benchmark world on this machine (shared by the spawned benchmarks)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any


def init_cpu_rank(rank: int, world: int, port: int, *,
                  before_init: Callable[[], Any] | None = None) -> Any:
    """CPU patches on, one thread, then join the gloo group on ``127.0.0.1:port``;
    ``before_init`` runs just before joining (e.g. to wrap ``torch.distributed``). Returns what
    ``before_init`` returned."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    from nemo_nutp.compat.cpu import apply_cpu_patches

    apply_cpu_patches()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = before_init() if before_init is not None else None
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return out
