"""Local rank processes (``nutp-train`` without a launcher, the Bridge CLI, the tests' worlds).

The ranks start from a fork server that imported torch, megatron-core and the training modules
once: a world of W local ranks pays the ~6 CPU-s of imports once instead of W times (on a
2-core machine a 7-rank world spent ~20 s of wall time importing). The server is a fresh
interpreter that only imported modules (no threads, no process group, no CUDA context), so a
fork from it is as clean as a new process. The recovery supervisor starts its ranks the same
way (``recovery/world.py`` ``PRELOAD``).

A fork server keeps the environment it started with; ranks get the caller's environment at
the time of the call (so a second world of the same process sees what changed in between).
With CUDA present the ranks are plain ``spawn``\\ ed processes: the preload imports would query
the device in the server, and a CUDA driver initialised before a fork is not usable after it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

PRELOAD = ("torch", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.distributed", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "nemo_nutp.train.worker",
           "nemo_nutp.train.session", "nemo_nutp.train.loop", "nemo_nutp.checkpoint.hooks")
"""What the fork server imports before the first rank forks from it."""


def _enter(index: int, env: dict[str, str], fn: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(index, *args)


def start_method() -> str:
    """``forkserver`` on a machine without CUDA, else ``spawn`` (see the module docstring)."""
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int,
                preload: Iterable[str] = PRELOAD) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` from the fork server: ``fn(i, *args)``
    in each of ``nprocs`` processes, joined; a rank's exception or exit raises in the caller as
    with ``spawn`` (``ProcessRaisedException`` / ``ProcessExitedException``)."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = start_method()
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(preload))
    mp.start_processes(_enter, args=(dict(os.environ), fn, *args), nprocs=nprocs,
                       join=True, start_method=method)
