"""The one module of the live path that knows gloo from NCCL: unblock a rank, drop a world,
join a new one.

Why this exists: a survivor of a failure is usually blocked inside a collective with the dead
(or a blocked) rank. On gloo nothing can abort a posted collective in torch 2.13, and
megatron's TP collectives are synchronous, so without help the rank waits for the group's
timeout (30 min by default).

Design (gloo, measured by ``tests/recovery``):

* **Abortable waits.** ``install()`` replaces ``torch.distributed.Work.wait`` (a pybind class:
  the replacement is seen by *every* wait, the blocking collectives' own ``work.wait()`` in
  ``distributed_c10d``, megatron's TP collectives, the sync engine's async works and the
  pipeline's p2p included) by a wait in slices of ``SLICE_S`` that raises ``Aborted`` once the
  rank's abort flag is set (collectives; a gloo send/recv is waited on a helper thread
  instead, since a timed-out p2p wait closes gloo's pair). The flag is set by the rank's
  control thread when the control process posts an abort (``live.py``); a completed work
  returns at once, so a healthy step pays nothing but one Python frame per wait. A peer that
  died closes its sockets: gloo then fails the work by itself (``RuntimeError``), which the
  live path treats like ``Aborted``.
* **Dropping the old world.** The posted operations of an aborted step are still queued in the
  old groups' gloo worker threads; destroying such a group joins those threads, i.e. waits for
  the peers. ``abandon()`` therefore unregisters every group (``destroy_process_group``) but
  keeps the group objects alive (``_GRAVEYARD``): their destructors never run during the job,
  the stuck operations end at the old groups' timeout or when the peer process exits, on
  threads nobody waits for. The cost is each old group's threads and socket pairs, never the
  model (groups hold only the buffers of the operations in flight).
* **NCCL** (untested: no GPU here): ``abandon()`` calls ``ProcessGroup.abort()`` on every group
  first (what nvidia-resiliency-ext does from its monitor thread), which makes in-flight NCCL
  kernels and waits return; ``shrink_group`` (torch >= 2.10, NCCL >= 2.27) could replace the
  full re-initialisation for groups that only lose members, but a re-planned layout changes
  the TP groups themselves, so every group is rebuilt here.
* **New world.** ``join(store, gen, rank, world)`` initialises the default group on the store
  prefix ``world<gen>/`` of the control process's store (the store outlives every rank).

Not guaranteed: a rank blocked outside ``Work.wait`` (a C++ call that waits internally, e.g.
``monitored_barrier``, or a ``TCPStore`` get) is not unblocked by the flag; the live path uses
none inside a step.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

SLICE_S = 0.02
"""Longest time an aborted wait keeps waiting after the flag is set."""

_GRAVEYARD: list[Any] = []
"""Process groups of abandoned worlds (kept alive on purpose, see the module docstring)."""


class Aborted(RuntimeError):
    """The control process stopped this world (``Work.wait`` left early)."""


class AbortFlag:
    """Set by the control thread when the world this rank is in is stopped."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.set_at: float | None = None
        self.why = ""

    def set(self, why: str) -> None:
        self.why, self.set_at = why, time.time()
        self._event.set()

    def clear(self) -> None:
        self._event.clear()
        self.set_at, self.why = None, ""

    def is_set(self) -> bool:
        return self._event.is_set()


FLAG = AbortFlag()
"""This process's flag (one training world per process at a time)."""

_ORIGINAL_WAIT: Any = None


_SLICEABLE = ("BROADCAST", "ALLREDUCE", "ALLREDUCE_COALESCED", "REDUCE", "ALLGATHER",
              "_ALLGATHER_BASE", "ALLGATHER_COALESCED", "GATHER", "SCATTER", "REDUCE_SCATTER",
              "_REDUCE_SCATTER_BASE", "ALLTOALL_BASE", "ALLTOALL", "BARRIER")
"""Collectives whose ``wait(timeout)`` only times out the wait (c10d's condition variable);
anything else (send, recv, coalesced, unknown) is waited on a helper thread."""
_SLICE_OPS: set[int] = set()


def _sliceable(work: Any) -> bool:
    if not _SLICE_OPS:
        from torch._C._distributed_c10d import OpType  # type: ignore[attr-defined]

        _SLICE_OPS.update(int(OpType.__members__[n].value) for n in _SLICEABLE
                          if n in OpType.__members__)
    try:
        return int(work._get_op_type()) in _SLICE_OPS
    except Exception:
        return False


def _wait_on_thread(work: Any, timeout: timedelta | None) -> bool:
    """A gloo send/recv must not be waited in slices: a timed-out ``wait(timeout)`` closes the
    pair ("Application timeout caused pair closure"). A helper thread waits for it without a
    timeout; this thread watches the flag. An aborted wait leaves the helper blocked until the
    pair closes (the peer died or left), on a daemon thread nobody joins."""
    original = _ORIGINAL_WAIT
    assert original is not None
    done = threading.Event()
    box: list[BaseException | bool] = []

    def run() -> None:
        try:
            box.append(bool(original(work)))
        except BaseException as e:  # handed to the waiting thread
            box.append(e)
        done.set()

    threading.Thread(target=run, name="nutp-p2p-wait", daemon=True).start()
    deadline = None if timeout is None or timeout == timedelta(0) else \
        time.monotonic() + timeout.total_seconds()
    while not done.wait(SLICE_S):
        if FLAG.is_set():
            raise Aborted(FLAG.why)
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"work did not complete within {timeout}")
    (res,) = box
    if isinstance(res, BaseException):
        raise res
    return res


def _abortable_wait(self: Any, timeout: timedelta | None = None) -> bool:
    original = _ORIGINAL_WAIT
    assert original is not None
    if FLAG.is_set():
        raise Aborted(FLAG.why)
    if not _sliceable(self):
        return _wait_on_thread(self, timeout)
    deadline = None if timeout is None or timeout == timedelta(0) else \
        time.monotonic() + timeout.total_seconds()
    step = timedelta(seconds=SLICE_S)
    while True:
        try:
            return bool(original(self, step))
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise  # the work failed (a peer died): the caller sees gloo's error
        if FLAG.is_set():
            raise Aborted(FLAG.why)
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"work did not complete within {timeout}")


def install() -> None:
    """Make every ``Work.wait`` of this process abortable (idempotent; gloo and NCCL alike:
    under NCCL ``abandon`` also aborts the groups, which ends waits the flag cannot)."""
    global _ORIGINAL_WAIT
    work = dist.Work
    if _ORIGINAL_WAIT is None:
        _ORIGINAL_WAIT = work.wait
        work.wait = _abortable_wait  # type: ignore[method-assign]


def uninstall() -> None:
    global _ORIGINAL_WAIT
    if _ORIGINAL_WAIT is not None:
        dist.Work.wait = _ORIGINAL_WAIT  # type: ignore[method-assign]
        _ORIGINAL_WAIT = None


def _groups() -> list[Any]:
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def abandon() -> int:
    """Leave the current world: abort its groups (NCCL), unregister them, keep their objects
    (gloo: their stuck operations end on threads nobody joins). Returns the number of groups."""
    if not dist.is_initialized():
        return 0
    groups = _groups()
    if dist.get_backend() == "nccl":
        for pg in groups:
            try:
                pg.abort()
            except Exception:  # already aborted or not supported: dropped anyway
                pass
    _GRAVEYARD.extend(groups)
    dist.destroy_process_group()
    from ..checkpoint import integrity

    integrity._CONTROL = None  # its cached object-collective group was the old world's
    return len(groups)


def join(store: Any, *, gen: int, rank: int, world: int, backend: str,
         timeout_s: float) -> None:
    """Initialise the default group of world ``gen`` on the control process's store."""
    dist.init_process_group(backend, store=dist.PrefixStore(f"world{gen}/", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
