"""Helper processes that must not outlive the rank that started them (no heavy imports here:
spawned helpers import this module).

megatron-core's ``dist_checkpointing`` collects writer results through a queue served by a
``multiprocessing`` manager process, created on the first save and kept for the life of the
rank. When a rank is SIGKILLed (a fault, the OOM killer, a lost GPU) that manager lives on,
holding the job's stdout/stderr open, so a launcher or a test reading the output waits forever.
``results_queue_dies_with_rank`` creates that queue in a manager that gets SIGKILL when its
parent dies (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child process: ask the kernel for SIGKILL when the parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import os

        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)


def results_queue_dies_with_rank() -> None:
    """Give megatron's checkpoint writer results queue a manager that dies with this rank.
    Idempotent; a no-op once megatron made its own queue."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if getattr(fa, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    fa._nutp_results_manager = manager  # keep it referenced for the life of the rank
    fa._results_queue = manager.Queue()
