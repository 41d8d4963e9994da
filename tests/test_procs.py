"""A SIGKILLed rank leaves no checkpoint-writer helper behind (``nemo_nutp.procs``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent("""
    import multiprocessing as mp
    from nemo_nutp.procs import results_queue_dies_with_rank
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    if {ours}:
        results_queue_dies_with_rank()
    q = fa._get_write_results_queue()
    q.put(1)
    assert q.get() == 1
    print(*[p.pid for p in mp.active_children()], flush=True)
    import time
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def _orphans_after_kill(ours: bool) -> list[int]:
    p = subprocess.Popen([sys.executable, "-c", CHILD.format(ours=ours)], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    assert p.stdout is not None
    helpers = [int(x) for x in p.stdout.readline().split()]
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(h) for h in helpers):
        time.sleep(0.1)
    left = [h for h in helpers if _alive(h)]
    for h in left:
        os.kill(h, signal.SIGKILL)
    return left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_writer_results_manager_dies_with_the_rank() -> None:
    assert _orphans_after_kill(ours=True) == []
    # Negative control: megatron's own manager outlives a SIGKILLed rank.
    assert _orphans_after_kill(ours=False) != []


def test_memfd_results_queue_starts_no_process_and_crosses_fork() -> None:
    """Ours is a memfd queue: no helper process; a forked writer's large result (bigger than
    a pipe buffer) arrives whole, in order, with the writer already gone."""
    import multiprocessing as mp
    import queue

    from nemo_nutp.procs import MemfdQueue

    q = MemfdQueue()
    assert mp.active_children() == []
    big = list(range(200_000))
    p = mp.get_context("fork").Process(target=lambda: (q.put(big), q.put("second")))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 0
    assert q.get_nowait() == big and q.get_nowait() == "second"
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.put(3)  # same process (synchronous saves): put, then get
    assert q.get_nowait() == 3
