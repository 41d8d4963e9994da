"""Issue #16: a hang is blamed on the hung rank only, also on a machine busier than its cores.

Four gloo ranks (TP pairs {0,1} {2,3}, DP pairs {0,2} {1,3}) run trials of one TP collective and
then one DP collective issued by a helper thread while the main thread waits on its future
(``threading`` wait: what the flaky ft_launcher test saw on its innocent rank 1). In trial ``t``
rank ``HUNG[t]`` sleeps at the start until the test releases it. Its TP peer blocks on it, the
other pair's DP collectives block on it or on that peer (a chain), and a CPU hog with more busy
processes than cores runs beside them. The test decides with the supervisor's own inputs
(heartbeats, stack watcher reports, collective counts) and ``blame_hang``; every trial must blame
exactly the hung rank. Before the collective counts, the victims waiting in ``threading`` (and
the chain's middle rank, once its watcher saw it blocked) were blamed too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_nutp.common.ports import free_port
from nemo_nutp.health import watch
from nemo_nutp.health.decisions import blame_hang

WORLD = 4
HUNG = (0, 3, 1, 2, 0, 2, 3, 1, 1, 0)  # 10 trials, every rank hung more than once
TIMEOUT_S = 3.0


def _beat(hb: Path, rank: int, phase: str, step: int) -> None:
    tmp = hb / f"rank{rank}.tmp"
    tmp.write_text(f"{phase} {step} {time.time()}")
    os.replace(tmp, hb / f"rank{rank}")


def _rank(rank: int, port: int, hb_dir: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    hb = Path(hb_dir)
    watch.start_stack_watcher(hb / f"rank{rank}.stack")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    tp = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    dp = [dist.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
    x = torch.ones(1024)
    with ThreadPoolExecutor(1) as pool:
        for t, hung in enumerate(HUNG):
            _beat(hb, rank, "start", t)
            if rank == hung:
                while not (hb / f"release{t}").exists():
                    time.sleep(0.05)
            dist.all_reduce(x, group=tp)
            pool.submit(dist.all_reduce, x, group=dp).result()
            _beat(hb, rank, "done", t)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_hang_blames_only_the_hung_rank_under_a_cpu_hog(tmp_path: Path) -> None:
    import multiprocessing as mp

    hb = tmp_path / "heartbeats"
    hb.mkdir()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range((os.cpu_count() or 2) + 2)]
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(hb))) for r in range(WORLD)]
    blamed: list[tuple[int, ...]] = []
    try:
        for p in procs:
            p.start()
        started = time.time()
        for t in range(len(HUNG)):
            deadline = time.time() + 180
            while True:
                time.sleep(0.1)
                assert all(p.exitcode in (None, 0) for p in procs), "a rank died"
                assert time.time() < deadline, f"trial {t}: no hang found"
                progress = watch.read_progress(hb, WORLD)
                if any(b is None or b.step < t for b in progress.values()):
                    continue  # not every rank reached this trial yet
                f = blame_hang(progress, now=time.time(), timeout_s=TIMEOUT_S,
                               started_at=started, startup_timeout_s=600,
                               activity=watch.read_activity(hb, WORLD),
                               collectives=watch.read_collectives(hb, WORLD))
                if f is not None:
                    blamed.append(f.ranks)
                    break
            (hb / f"release{t}").touch()
        for p in procs:
            p.join(timeout=120)
        assert all(p.exitcode == 0 for p in procs)
    finally:
        for h in hogs:
            h.kill()
        for p in procs:
            if p.is_alive():
                p.kill()
    assert blamed == [(h,) for h in HUNG], blamed
