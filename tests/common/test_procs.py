"""A SIGKILLed rank leaves no checkpoint-writer helper behind (``nemo_nutp.common.procs``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import multiprocessing as mp
    from nemo_nutp.common.procs import results_queue_dies_with_rank
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

    from nemo_nutp.common.procs import MemfdQueue

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



WRITERS = textwrap.dedent("""
    import errno, functools, json, os, sys, time
    from pathlib import Path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
    from nemo_nutp.compat.cpu import apply_cpu_patches
    apply_cpu_patches()
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    from megatron.core.dist_checkpointing.strategies.async_utils import (
        AsyncCallsQueue, AsyncRequest)
    from nemo_nutp.checkpoint.background import BackgroundSaves
    from nemo_nutp.common.procs import results_queue_dies_with_rank
    results_queue_dies_with_rank()
    root = Path(sys.argv[1])
    lines, done = [], []
    saves = BackgroundSaves(on_done=lambda p, s: done.append(p.step),
                            on_failed=lambda p, line: lines.append(line))

    def save(step):
        tmp = root / f"iter_{{step}}.tmp-x"
        tmp.mkdir(parents=True)
        state = {{"w": ShardedTensor.from_rank_offsets("w", torch.full((1000,), float(step)))}}
        req = dist_checkpointing.save(state, str(tmp), async_sharded_save=True)
        saves.schedule(req, tmp, root / f"iter_{{step}}", step,
                       lambda digests: os.rename(tmp, root / f"iter_{{step}}"))
        saves.wait()

    if {ours}:  # a save, then one whose write fails for lack of space
        save(1)
        write_item = fa._write_item
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        fa._write_item = full  # inside megatron's writer: the error reaches its results
        save(2)
        fa._write_item = write_item
        print(json.dumps({{"done": done, "lines": lines,
                          "dirs": sorted(p.name for p in root.iterdir())}}), flush=True)
    # a background write that would take 10 minutes; this rank gets SIGKILLed
    request = AsyncRequest(async_fn=functools.partial(time.sleep, 600), async_fn_args=(),
                           finalize_fns=[])
    if {ours}:
        saves.schedule(request, root / "x", root / "y", 3, lambda digests: None)
        queue = saves.queue
    else:
        print("{{}}", flush=True)
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
    print(queue.async_calls[0].async_caller.process.pid, flush=True)
    time.sleep(600)
""")


def _writers(ours: bool, root: Path) -> tuple[dict, list[int]]:
    """Run WRITERS; SIGKILL it once its last writer runs. (its first report, orphans)."""
    import json

    from nemo_nutp.common.ports import free_port

    p = subprocess.Popen([sys.executable, "-c", WRITERS.format(ours=ours, port=free_port()),
                          str(root)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout is not None
        report = json.loads(p.stdout.readline())
        writer = int(p.stdout.readline())
        assert _alive(writer)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and _alive(writer):
        time.sleep(0.1)
    if _alive(writer):
        os.kill(writer, signal.SIGKILL)
        return report, [writer]
    return report, []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_background_writer_failure_aborts_and_writer_dies_with_the_rank(tmp_path: Path) -> None:
    """A background write that fails (no space left) aborts that save: one line naming its
    directory and the error, the directory removed, the previous checkpoint untouched. A rank
    SIGKILLed while its background writer runs takes the writer with it; megatron's own
    writer outlives the rank (control)."""
    report, left = _writers(True, tmp_path / "ours")
    assert left == []
    assert report["done"] == [1] and report["dirs"] == ["iter_1"], report
    (line,) = report["lines"]
    assert "iter_2.tmp-x" in line and "No space left" in line and "\n" not in line, line
    assert "previous complete checkpoint" in line, line
    _, left = _writers(False, tmp_path / "megatron")
    assert left != []
