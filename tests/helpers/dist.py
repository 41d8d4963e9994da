"""Helpers for multi-process (gloo) tests: free ports, the rank wrapper, the spawner."""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_nutp.common.ports import free_port

__all__ = ["free_port", "gloo_rank", "spawn"]


def gloo_rank(rank: int, world: int, port: int, outdir: str, body: Callable[[], None]) -> None:
    """Run ``body`` as one CPU/gloo rank (CPU patches on, 1 thread, deterministic); a failure
    leaves its traceback in ``outdir/error_rank{rank}.txt`` for the test to show."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    try:
        from nemo_nutp.compat.cpu import apply_cpu_patches

        apply_cpu_patches()
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        body()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn(worker: Callable[..., None], world: int, args: tuple[Any, ...], outdir: Path) -> None:
    """``mp.spawn(worker, (world, port, *args, outdir))`` from the shared fork server
    (``nemo_nutp/launch/local.py``: the imports are paid once per test session, not per rank
    per world); print the first rank error on failure."""
    from nemo_nutp.launch.local import start_ranks

    try:
        start_ranks(worker, (world, free_port(), *args, str(outdir)), world)
    finally:
        errors = sorted(outdir.glob("error_rank*.txt"))
        if errors:
            print(errors[0].read_text())
