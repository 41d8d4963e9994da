"""Hang detection whose cost on a training rank does not grow with the world (issue #22,
finding 4): one node watchdog per node, one job-level aggregator off the training ranks.

* **Rank** (unchanged): its step heartbeat (``checkpoint/hooks.py``) and its stack watcher
  (``watch.watch_stack``: waiting flag, activity time, innermost frame, collective counts keyed
  by group *name*) write two small files into a **node-local** directory (``node_dir``: tmpfs
  where there is one), not the shared filesystem.
* **Node watchdog** (a thread of the node's lowest plan rank, ``NodeWatch``): every
  ``NODE_POLL_S`` it reads its node's ranks' files (``gpus_per_node`` of them: O(1) in W) into
  a digest (``node_digest``): a summary (newest heartbeat, latest activity, highest completed
  step) and the per-rank detail, published under ``node_key(n)``/``detail_key(n)`` (one store
  ``multi_set`` per node per period, not one file per rank per half-second on a shared
  filesystem).
* **Job aggregator** (``Aggregator``; under an external launcher its own process, started by
  launcher rank 0: ``python -m nemo_nutp.health.aggregate``): every ``NODE_POLL_S`` it
  fetches all node summaries at once (``multi_get``, O(nodes)) and decides whether progress
  stalled (``stalled``: ``blame_hang``'s own rule); only then does it fetch the details, merge
  them (O(W)) and run ``decisions.blame_hang`` (O(W + entries): the group-count analysis is per
  group min/max, ``decisions.hang_roots``) to name the ranks and where they were. It keeps the
  highest completed step (for lost-step accounting).

The rank side therefore costs O(1) per rank; the aggregator O(W) in one process that trains
nothing (``benchmarks/rank_at_scale.py`` reports both: ``watchdog_poll_s`` and
``aggregator_poll_s``). The CPU supervisor (``supervisor.py``, ``control.py``) is itself such a
job-level process on one machine: it reads the per-rank files directly (``Aggregator`` over
``DirSource``), the same analysis.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..common.env import NODE_DIR
from .decisions import Activity, Failure, Progress, blame_hang

NODE_POLL_S = 0.5


def node_key(node: int) -> str:
    """A node's summary (small: read every poll)."""
    return f"watch/node{node}"


def detail_key(node: int) -> str:
    """A node's per-rank detail (read only when progress stalled)."""
    return f"watch/detail{node}"


def node_dir(run: str, attempt: int) -> Path:
    """This node's directory for its ranks' heartbeat and stack files of one attempt (node-local:
    ``/dev/shm`` where it exists, else the temporary directory; ``NUTP_NODE_DIR`` overrides)."""
    base = os.environ.get(NODE_DIR) or ("/dev/shm" if os.path.isdir("/dev/shm")
                                               else tempfile.gettempdir())
    return Path(base) / f"nutp-{run}" / f"a{attempt}"


def _rank_entry(hb_dir: Path, r: int) -> list[Any]:
    """``[progress, activity, counts, where]`` of one rank from its two files (None where a
    file is missing or unreadable)."""
    progress = activity = counts = None
    where = "?"
    try:
        phase, step, t = (hb_dir / f"rank{r}").read_text().split()
        progress = [phase, int(step), float(t)]
    except (OSError, ValueError):
        pass
    try:
        lines = (hb_dir / f"rank{r}.stack").read_text().split("\n")
        waiting, changed, t = lines[0].split()
        activity = [waiting == "1", float(changed), float(t)]
        where = lines[1]
        counts = json.loads(lines[2])
    except (OSError, ValueError, IndexError):
        pass
    return [progress, activity, counts, where]


def node_digest(hb_dir: Path, ranks: Sequence[int]) -> tuple[str, str]:
    """What a node's ranks last reported (O(ranks on the node)), as two JSON strings: the
    summary (newest step heartbeat and its phase, latest activity, highest completed step: all
    the aggregator needs to see whether progress stalled) and the per-rank detail (what
    ``blame_hang`` needs to name the ranks, read only after a stall)."""
    ranks_out = {str(r): _rank_entry(hb_dir, r) for r in ranks}
    return (json.dumps(summarize(ranks_out.values()), separators=(",", ":")),
            json.dumps({"r": ranks_out}, separators=(",", ":")))


def summarize(entries: Any) -> dict[str, Any]:
    """A node's summary from its ranks' ``[progress, activity, counts, where]`` entries."""
    beats = [e[0] for e in entries if e[0] is not None]
    busy = [e[1][1] for e in entries if e[1] is not None]
    newest = max(beats, key=lambda p: p[2]) if beats else None
    done = [p[1] if p[0] == "done" else p[1] - 1 for p in beats]
    return {"t": time.time(), "beat": None if newest is None else [newest[2], newest[0]],
            "busy": max(busy) if busy else None, "done": max(done) if done else None}


def stalled(summaries: Sequence[str | bytes | None], now: float, *, timeout_s: float,
            started_at: float, startup_timeout_s: float) -> tuple[bool, int | None]:
    """From node summaries: whether ``blame_hang`` would find a hang now (the same rule: no
    heartbeat or activity for ``timeout_s``; activity counts between steps), and the highest
    completed step. O(nodes)."""
    beat: tuple[float, str] | None = None
    busy: float | None = None
    done: int | None = None
    for raw in summaries:
        if not raw:
            continue
        try:
            d = json.loads(raw)
        except ValueError:
            continue
        if d["beat"] is not None and (beat is None or d["beat"][0] > beat[0]):
            beat = (d["beat"][0], d["beat"][1])
        if d["busy"] is not None and (busy is None or d["busy"] > busy):
            busy = d["busy"]
        if d["done"] is not None and (done is None or d["done"] > done):
            done = d["done"]
    if beat is None:
        last = busy if busy is not None else started_at
        return now - started_at > startup_timeout_s and now - last > timeout_s, done
    last = max(beat[0], busy if beat[1] == "done" and busy is not None else beat[0])
    return now - last > timeout_s, done


class Merged:
    """All ranks' reports, merged from node digests: ``blame_hang``'s inputs."""

    def __init__(self, world: int) -> None:
        self.progress: dict[int, Progress | None] = dict.fromkeys(range(world))
        self.activity: dict[int, Activity | None] = dict.fromkeys(range(world))
        self.collectives: dict[int, dict[str, int] | None] = dict.fromkeys(range(world))
        self.where: dict[int, str] = {}

    def add(self, digest: str | bytes | None) -> None:
        if not digest:
            return
        try:
            ranks = json.loads(digest)["r"]
        except (ValueError, KeyError, TypeError):
            return
        for key, (p, a, c, w) in ranks.items():
            r = int(key)
            if r not in self.progress:
                continue
            self.progress[r] = Progress(p[0], p[1], p[2]) if p else None
            self.activity[r] = Activity(a[0], a[1], a[2]) if a else None
            self.collectives[r] = c
            self.where[r] = w

    def last_done(self) -> int | None:
        done = [p.step if p.phase == "done" else p.step - 1
                for p in self.progress.values() if p is not None]
        return max(done) if done else None


class Aggregator:
    """The job-level hang check over all ranks (``poll``). ``source`` gives the nodes'
    summaries (every poll: O(nodes)) and details (only once progress stalled: O(W))."""

    def __init__(self, source: Any, world: int, *, timeout_s: float,
                 startup_timeout_s: float, started_at: float) -> None:
        self.source, self.world = source, world
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.started_at = started_at
        self.last_done: int | None = None
        self.where: dict[int, str] = {}

    def poll(self, now: float) -> Failure | None:
        stuck, done = stalled(self.source.summaries(), now, timeout_s=self.timeout_s,
                              started_at=self.started_at,
                              startup_timeout_s=self.startup_timeout_s)
        if done is not None and (self.last_done is None or done > self.last_done):
            self.last_done = done
        if not stuck:
            return None
        m = Merged(self.world)
        for d in self.source.details():
            m.add(d)
        self.where = m.where
        return blame_hang(m.progress, now=now, timeout_s=self.timeout_s,
                          started_at=self.started_at, startup_timeout_s=self.startup_timeout_s,
                          activity=m.activity, collectives=m.collectives)


class DirSource:
    """Digests of ranks whose files are in one directory (one machine: the CPU supervisor, or
    tests): the aggregator reads them itself, ``per`` ranks per digest."""

    def __init__(self, hb_dir: Path, world: int, per: int = 8) -> None:
        self.hb_dir, self.world, self.per = hb_dir, world, per

    def _digests(self) -> list[tuple[str, str]]:
        return [node_digest(self.hb_dir, range(a, min(a + self.per, self.world)))
                for a in range(0, self.world, self.per)]

    def summaries(self) -> list[str]:
        return [s for s, _ in self._digests()]

    def details(self) -> list[str]:
        return [d for _, d in self._digests()]


class StoreSource:
    """Digests published in a store for ``nodes`` nodes: one round trip each (``multi_get``;
    every key is set before the first poll, see ``preset``)."""

    def __init__(self, store: Any, nodes: int) -> None:
        self.store = store
        self.summary_keys = [node_key(n) for n in range(nodes)]
        self.detail_keys = [detail_key(n) for n in range(nodes)]

    def summaries(self) -> list[bytes]:
        return list(self.store.multi_get(self.summary_keys))

    def details(self) -> list[bytes]:
        return list(self.store.multi_get(self.detail_keys))


def preset(store: Any, nodes: int) -> None:
    """Empty digests for every node (one ``multi_set``), so the aggregator's ``multi_get``
    never waits for a node that has not published yet."""
    keys = [node_key(n) for n in range(nodes)] + [detail_key(n) for n in range(nodes)]
    store.multi_set(keys, [""] * len(keys))


class NodeWatch:
    """A node's watchdog: ``poll`` reads the node's ranks' files and publishes its summary and
    detail (one ``multi_set``)."""

    def __init__(self, hb_dir: Path, ranks: Sequence[int], node: int, store: Any) -> None:
        self.hb_dir, self.ranks, self.store = hb_dir, list(ranks), store
        self.keys = [node_key(node), detail_key(node)]

    def poll(self) -> None:
        self.store.multi_set(self.keys, list(node_digest(self.hb_dir, self.ranks)))

    def start(self) -> threading.Thread:
        def run() -> None:
            while True:
                try:
                    self.poll()
                except Exception:  # a store hiccup: the next period publishes again
                    pass
                time.sleep(NODE_POLL_S)

        t = threading.Thread(target=run, name="nutp-node-watch", daemon=True)
        t.start()
        return t


def node_ranks(rank_to_gpu: Sequence[int], gpus_per_node: int, node: int) -> list[int]:
    """Plan ranks whose GPU is on ``node`` (GPU slots are node-major)."""
    return [r for r, g in enumerate(rank_to_gpu) if g // gpus_per_node == node]


# ---------------------------------------------------------------------------------------------
# The aggregator process under an external launcher
# ---------------------------------------------------------------------------------------------


def spawn(*, host: str, port: int, prefix: str, rdir: Path, attempt: int, world: int,
          nodes: int, timeout_s: float, startup_timeout_s: float) -> Any:
    """Start the aggregator process (``main``) as a child of this worker. Its output goes to
    ``rdir/aggregate.<attempt>.log``, never to the launcher's stdout/stderr: a process that
    holds a launcher's pipes keeps whoever reads them waiting (a CI run's ``communicate()`` on
    torchrun waited 800 s for an attempt-0 aggregator after the job itself had exited 0)."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "nemo_nutp.health.aggregate", "--host", host, "--port",
            str(port), "--prefix", prefix, "--rdir", str(rdir), "--attempt", str(attempt),
            "--world", str(world), "--nodes", str(nodes), "--timeout", str(timeout_s),
            "--startup-timeout", str(startup_timeout_s), "--parent", str(os.getpid())]
    Path(rdir).mkdir(parents=True, exist_ok=True)
    with open(Path(rdir) / f"aggregate.{attempt}.log", "ab") as log:
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)


ORPHAN_GRACE_S = 10.0
"""How long an aggregator outlives its parent worker: the loop's last look and progress
record take well under a second; past this, a store call blocked on a torn-down attempt
must not keep the process (``_exit_when_orphaned``)."""


def _exit_when_orphaned(parent: int) -> None:
    """A daemon thread that ends the process ``ORPHAN_GRACE_S`` after its parent is gone,
    whatever the main loop is blocked in (a store call waits up to the store's timeout)."""
    def watch() -> None:
        gone = None
        while True:
            time.sleep(0.5)
            if os.getppid() == parent:
                continue
            gone = gone or time.monotonic()
            if time.monotonic() - gone > ORPHAN_GRACE_S:
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="nutp-orphan-watch").start()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_aggregator(store: Any, agg: Aggregator, *, rdir: Path, attempt: int, parent: int
                   ) -> int:
    """The aggregator's loop: until the attempt ends (``abort``/``finished`` keys, or the
    parent worker is gone). On a hang: ``hang.<attempt>.json``, the ``hang_detected`` event,
    then the ``abort`` key (every worker's control thread ends it). The highest completed step
    goes to ``progress.<attempt>.json`` whenever it grows (and at the end), for lost steps."""
    from ..common.events import log_event
    from ..layout.serialize import write_json_atomic

    progress = rdir / f"progress.{attempt}.json"
    # A flag, not a threading.Event: a handler that takes the Event's lock while the loop's own
    # wait holds it deadlocks for good (an orphaned aggregator was found in that futex wait an
    # hour after its SIGTERM, PR_SET_PDEATHSIG's, with SIGTERM no longer able to end it).
    stop = [False]

    def _on_term(*_: Any) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _on_term)
    written = None
    while not stop[0]:
        now = time.time()
        try:
            failure = agg.poll(now)
            ended = store.check(["abort"]) or store.check(["finished"])
        except Exception:  # the store is gone: the attempt is over
            break
        if agg.last_done != written:
            written = agg.last_done
            write_json_atomic({"last_done": written, "t": now}, progress)
        if failure is not None:
            where = {str(r): agg.where.get(r, "?") for r in failure.ranks}
            write_json_atomic({"ranks": list(failure.ranks), "reason": failure.reason,
                               "detected_at": now, "where": where},
                              rdir / f"hang.{attempt}.json")
            log_event("hang_detected", file=rdir / "events.jsonl", attempt=attempt,
                      ranks=list(failure.ranks), reason=failure.reason, where=where)
            store.set("abort", "hang")
            return 0
        if ended or os.getppid() != parent:
            break
        time.sleep(NODE_POLL_S)
    try:  # a last look (a step finished since the last period counts as done)
        agg.poll(time.time())
    except Exception:
        pass
    if agg.last_done != written:
        write_json_atomic({"last_done": agg.last_done, "t": time.time()}, progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="NUTP job-level hang aggregator (one per job)")
    for name in ("--host", "--prefix", "--rdir"):
        ap.add_argument(name, required=True)
    for name in ("--port", "--attempt", "--world", "--nodes", "--parent"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--startup-timeout", type=float, required=True)
    a = ap.parse_args(argv)
    _die_with_parent()
    _exit_when_orphaned(a.parent)
    import gc

    import torch.distributed as dist

    gc.freeze()  # the imports' objects: no full collection walks them every poll
    base = dist.TCPStore(a.host, a.port, is_master=False,
                         timeout=timedelta(seconds=max(60.0, a.startup_timeout)))
    store = dist.PrefixStore(a.prefix, base)
    agg = Aggregator(StoreSource(store, a.nodes), a.world, timeout_s=a.timeout,
                     startup_timeout_s=a.startup_timeout, started_at=time.time())
    return run_aggregator(store, agg, rdir=Path(a.rdir), attempt=a.attempt, parent=a.parent)


if __name__ == "__main__":
    raise SystemExit(main())
