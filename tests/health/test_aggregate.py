"""Issue #22 findings 4 and 8: node digests + job-level aggregator (no processes), and hang
blame from device progress (a stand-in for CUDA events: CPU-tested only)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

from nemo_nutp.health import aggregate
from nemo_nutp.health.decisions import Activity, Progress, blame_hang, hang_roots
from nemo_nutp.health.watch import CollectiveLog


class StandInEvent:
    """``torch.cuda.Event``'s two methods: completes once its device has not stalled."""

    def __init__(self, device: SimpleNamespace) -> None:
        self.device = device
        self.n = -1

    def record(self) -> None:
        self.device.recorded += 1
        self.n = self.device.recorded

    def query(self) -> bool:
        return self.n <= self.device.progress


def _run(log: CollectiveLog, groups: list[SimpleNamespace], calls: int) -> None:
    op = log.wrap(lambda tensor, group=None: None)
    for i in range(calls):
        op(None, group=groups[i % len(groups)])


def test_device_progress_blames_the_stalled_gpu_while_host_counts_are_equal() -> None:
    # TP {0,1}, one more group {0,1,2,3} (DP-like); rank 1's GPU stalls after 5 collectives'
    # worth of work (a kernel that never ends): NCCL calls return at once on every rank, so
    # every host entered all 8 collectives, but rank 1's device reached only 5.
    tp01 = SimpleNamespace(group_name="7")
    tp23 = SimpleNamespace(group_name="8")
    dp = SimpleNamespace(group_name="9")
    devices = {r: SimpleNamespace(recorded=0, progress=10**9) for r in range(4)}
    devices[1].progress = 5
    logs = {r: CollectiveLog(event=lambda r=r: StandInEvent(devices[r])) for r in range(4)}
    for r in range(4):
        _run(logs[r], [tp01 if r < 2 else tp23, dp], 8)
    host = {r: dict(logs[r].entered) for r in range(4)}
    device = {r: logs[r].counts() for r in range(4)}
    assert all(host[r] == host[0 if r < 2 else 2] for r in range(4))  # equal host counts
    assert hang_roots(host) == ()  # the host view blames nobody
    assert device[1] == {"7": 3, "9": 2} and device[0] == {"7": 4, "9": 4}
    assert hang_roots(device) == (1,)
    # what the aggregator decides: equal heartbeats, no host waiting in a collective (NCCL
    # returned), so only the device counts name the rank
    beats = {r: Progress("start", 3, 100.0) for r in range(4)}
    acts = {r: Activity(False, 100.0, 105.9) for r in range(4)}
    kw = dict(now=106.0, timeout_s=5.0, started_at=0.0, startup_timeout_s=50.0)
    f = blame_hang(beats, activity=acts, collectives=host, **kw)  # type: ignore[arg-type]
    assert f is not None and f.ranks == ()
    f = blame_hang(beats, activity=acts, collectives=device, **kw)  # type: ignore[arg-type]
    assert f is not None and f.ranks == (1,) and "behind" in f.reason
    # without events (CPU) the counts are the host's
    plain = CollectiveLog()
    _run(plain, [tp01], 3)
    assert plain.counts() == {"7": 3}


def _files(hb: Path, world: int, behind: int, now: float) -> None:
    for r in range(world):
        (hb / f"rank{r}").write_text(f"start 3 {now - 30}\n")
        tp, dp = f"tp{r // 8}", f"dp{r % 8}"
        counts = {tp: 12, dp: 40 if r != behind else 39}
        (hb / f"rank{r}.stack").write_text(
            f"1 {now - 30} {now}\nloop.py:{r} in train_rank\n{json.dumps(counts)}\n")


def test_node_digests_through_a_store_and_the_aggregator_blame(tmp_path: Path) -> None:
    import torch.distributed as dist

    world, per, behind = 32, 8, 13
    now = time.time()
    _files(tmp_path, world, behind, now)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    store = dist.PrefixStore("nutp/attempt0/", server)
    nodes = world // per
    aggregate.preset(store, nodes)
    agg = aggregate.Aggregator(aggregate.StoreSource(store, nodes), world, timeout_s=5.0,
                               startup_timeout_s=50.0, started_at=now - 100)
    f = agg.poll(now)  # nothing published yet: a start-up without any sign of life
    assert f is not None and f.ranks == () and "no heartbeat" in f.reason
    rank_to_gpu = list(range(world))
    for n in range(nodes):
        mine = aggregate.node_ranks(rank_to_gpu, per, n)
        assert mine == list(range(n * per, (n + 1) * per))
        aggregate.NodeWatch(tmp_path, mine, n, store).poll()
    assert agg.poll(now - 26) is None and agg.where == {}  # fresh: the summaries suffice
    assert agg.last_done == 2
    f = agg.poll(now)  # stalled: the details name the rank
    assert f is not None and f.ranks == (behind,) and "behind" in f.reason
    assert agg.where[behind] == f"loop.py:{behind} in train_rank" and agg.last_done == 2
    # the same analysis straight from the files (one machine: the CPU supervisor)
    direct = aggregate.Aggregator(aggregate.DirSource(tmp_path, world), world, timeout_s=5.0,
                                  startup_timeout_s=50.0, started_at=now - 100)
    f2 = direct.poll(now)
    assert f2 is not None and f2.ranks == (behind,)
    # the aggregator's loop: records the hang and sets the abort key
    rdir = tmp_path / "recovery"
    rdir.mkdir()
    assert aggregate.run_aggregator(store, agg, rdir=rdir, attempt=0, parent=os.getppid()) == 0
    hang = json.loads((rdir / "hang.0.json").read_text())
    assert hang["ranks"] == [behind] and hang["where"] == {str(behind): f"loop.py:{behind} in "
                                                                        "train_rank"}
    assert store.get("abort") == b"hang"
    assert json.loads((rdir / "progress.0.json").read_text())["last_done"] == 2


def _entry(beat: tuple[str, int, float] | None, act: tuple[bool, float, float] | None
           ) -> list[object]:
    return [None if beat is None else list(beat), None if act is None else list(act), {}, "-"]


def test_summaries_say_stalled_exactly_when_blame_hang_finds_a_hang() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    beat = st.none() | st.tuples(st.sampled_from(["start", "done"]), st.integers(0, 5),
                                 st.floats(0, 100))
    act = st.none() | st.tuples(st.booleans(), st.floats(0, 100), st.floats(0, 100))
    kw = dict(timeout_s=10.0, started_at=0.0, startup_timeout_s=40.0)

    @settings(max_examples=120, deadline=None)
    @given(st.lists(st.tuples(beat, act), min_size=1, max_size=24), st.floats(0, 120),
           st.integers(1, 8))
    def check(ranks: list, now: float, per: int) -> None:
        entries = [_entry(b, a) for b, a in ranks]
        nodes = [entries[i:i + per] for i in range(0, len(entries), per)]
        summaries = [json.dumps(aggregate.summarize(n)) for n in nodes]
        stuck, done = aggregate.stalled(summaries, now, **kw)  # type: ignore[arg-type]
        progress = {r: None if b is None else Progress(*b) for r, (b, _) in enumerate(ranks)}
        acts = {r: None if a is None else Activity(*a) for r, (_, a) in enumerate(ranks)}
        f = blame_hang(progress, now=now, activity=acts, **kw)  # type: ignore[arg-type]
        assert stuck == (f is not None)
        beats = [b for b, _ in ranks if b is not None]
        assert done == (max(s if p == "done" else s - 1 for p, s, _ in beats) if beats
                        else None)

    check()


def test_a_group_entered_but_not_reached_counts_zero() -> None:
    device = SimpleNamespace(recorded=0, progress=0)
    log = CollectiveLog(event=lambda: StandInEvent(device))
    _run(log, [SimpleNamespace(group_name="3")], 2)
    assert log.entered == {"3": 2} and log.counts() == {"3": 0}
    device.progress = 2
    assert log.counts() == {"3": 2}


def test_an_orphaned_aggregator_ends_and_never_holds_the_launchers_pipes(tmp_path: Path) -> None:
    """A CI run's torchrun job exited 0, but an attempt-0 aggregator outlived its worker with
    the launcher's stdout open, so the test's ``communicate()`` waited 800 s. Now ``spawn``
    writes the aggregator's output to ``rdir/aggregate.<attempt>.log``, and an aggregator
    whose parent is gone ends within ``ORPHAN_GRACE_S`` even while blocked in a store call:
    here it waits to connect to a store nobody serves, its ``--parent`` not its parent."""
    import subprocess
    import sys

    from nemo_nutp.common.ports import free_port

    args = [sys.executable, "-m", "nemo_nutp.health.aggregate", "--host", "127.0.0.1",
            "--port", str(free_port()), "--prefix", "p/", "--rdir", str(tmp_path),
            "--attempt", "0", "--world", "2", "--nodes", "1", "--timeout", "60",
            "--startup-timeout", "300", "--parent", "1"]
    t0 = time.monotonic()
    proc = subprocess.run(args, capture_output=True, timeout=120, check=False)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert aggregate.ORPHAN_GRACE_S <= took < aggregate.ORPHAN_GRACE_S + 60, took
    # spawn: the child's output goes to the attempt's log, not to this process's pipes
    child = aggregate.spawn(host="127.0.0.1", port=free_port(), prefix="p/", rdir=tmp_path,
                            attempt=3, world=2, nodes=1, timeout_s=60, startup_timeout_s=300)
    child.kill()
    child.wait()
    assert child.stdout is None and child.stderr is None
    assert (tmp_path / "aggregate.3.log").exists()

