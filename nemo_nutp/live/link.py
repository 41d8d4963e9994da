"""Rank side of a live re-layout (``recovery.mode=live``): vote, stop, report, rebuild, move.

The control process (``control.py``, in the supervisor) hosts the store every world is built
on (``world<gen>/`` prefixes) and makes every decision; a rank only reports and follows. The
protocol and its invariants are in ``commit.py``. Per rank and per step this costs one
all-reduce of one number (the vote) and nothing else: no store traffic, no polling; between
failures the rank's control thread sits in one blocking ``TCPStore.wait`` on the key
``abort<gen>``.

A re-layout on a rank, after its step failed (``backend.Aborted``, or gloo's error when a peer
died):

1. wait (bounded) until the control process has aborted the world: a rank that fails without
   an abort re-raises its error (an ordinary bug stays one);
2. report ``(step, phase)`` (``report<gen>/<slot>``) and wait for ``decision<gen>``;
3. apply the step's update if the decision says so (voted, result unknown, step committed);
4. abandon the old world, join ``world<gen+1>`` at the new rank (``slot``: the process's
   rank in world 0, its identity to the control process; new ranks follow the GPUs);
5. build the new session (the same builder as at start-up), move the state in memory
   (``nemo_nutp.relayout.move_state``: weights, fp32 masters, Adam moments from a survivor that
   holds them), carry the RNG state over.

A boundary re-layout (GPUs back, a straggler excluded; ``control.grow``) aborts nothing: the
control thread turns a ``grow`` value of ``abort<gen>`` into a bit of the next vote (``[1,
grow]``, still one all-reduce), every rank stops after that step, reports it committed
(``boundary``) and follows the same steps 4-5; a returning GPU's new process joins with nothing
(``live.manager.join``).

Never imported by the launcher side, and it imports nothing of it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ..common.env import CONTROL
from ..common.faults import Faults
from ..health.commit import GROW, Report
from . import backend

if TYPE_CHECKING:
    from ..layout import Plan

ABORT_WAIT_S = 30.0
"""How long a rank whose collective failed waits for the control process's abort."""


def control_address() -> tuple[str, int] | None:
    """``NUTP_CONTROL=host:port`` (set by the supervisor in live mode), or None."""
    spec = os.environ.get(CONTROL)
    if not spec:
        return None
    host, port = spec.rsplit(":", 1)
    return host, int(port)


def connect(host: str, port: int, timeout_s: float) -> Any:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         use_libuv=True)


@dataclass
class Committed:
    """The newest committed step as this rank knows it (its metrics row, if the world stopped
    before rank 0 wrote it)."""

    step: int = -1
    loss: float = float("nan")
    grad_norm: float | None = None
    step_s: float = 0.0  # this rank's time from the step's start to the vote


class LiveLink(Protocol):
    """What the training rank's live manager (``manager.LiveManager``) uses of its link to the
    control process; ``LiveRank`` is the one over the control process's TCP store."""

    slot: int  # this process's rank in world 0: its identity to the control process
    gen: int  # the world this rank is in
    step: int  # the step in flight
    loss: float  # its global loss (once voted)
    began: float  # when it began (perf_counter)
    committed: Committed  # the newest committed step as this rank knows it
    store: Any
    timeout_s: float
    injector: Faults | None  # injected faults (common/faults.py; phase faults fire here)
    old_replica_tp: Any  # the stopped world's replicas (its missing metrics row)
    grow_agreed: bool  # the last vote asked every rank to stop after this step

    def begin(self, step: int) -> None:
        """A step starts (phase ``compute``)."""

    def vote(self, loss: float) -> None:
        """The commit vote (one all-reduce); raises if the world stopped."""

    def stepped(self, grad_norm: float | None) -> None:
        """The committed step's grad norm (None: skipped)."""

    def stop(self, error: BaseException) -> tuple[Report, float]:
        """After a failed step: wait for the control process's abort, report."""

    def boundary(self) -> Report:
        """At an agreed step boundary: report the committed step."""

    def decision(self) -> dict[str, Any]:
        """The control process's decision for this world (blocking)."""

    def rejoin(self, *, rank: int, world: int, device: torch.device | None) -> None:
        """Leave the old world, join the next at ``rank``."""

    def post(self, key: str, value: dict[str, Any]) -> None:
        """Tell the control process ``key<gen>`` = ``value``."""


@dataclass
class LiveRank:
    """This process's link to the control process."""

    host: str
    port: int
    slot: int
    timeout_s: float
    gen: int = 0
    step: int = 0
    phase: str = "compute"
    began: float = 0.0
    loss: float = float("nan")
    committed: Committed = field(default_factory=Committed)
    store: Any = None
    injector: Faults | None = None  # injected faults (tests, demos): phase faults fire here
    old_replica_tp: Any = None  # the stopped world's replicas (its missing metrics row)
    grow_agreed: bool = False  # the last vote asked every rank to stop after this step
    _grow: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rejoined: threading.Event = field(default_factory=threading.Event)

    def start(self, *, gen: int = 0, cfg: Any = None) -> None:
        """Connect; ``gen``: the first world this process joins (a joiner: not 0); ``cfg``: the
        job's config (its ``recovery.fault(s)``; None: ``NUTP_FAULT`` only)."""
        self.gen = gen
        self.injector = Faults.from_env_or_config(cfg)
        backend.install()
        self.store = connect(self.host, self.port, self.timeout_s)
        watcher = connect(self.host, self.port, self.timeout_s)
        threading.Thread(target=self._watch, args=(watcher, gen), name="nutp-live-control",
                         daemon=True).start()

    def _watch(self, store: Any, gen: int) -> None:
        """Control thread: one blocking wait per world; sets the abort flag (a failure) or
        asks for a stop at the next step boundary (``grow...``: GPUs back, nothing failed)."""
        while True:
            key = f"abort{gen}"
            try:
                store.wait([key], timedelta(hours=24))
                why = store.get(key).decode()
            except Exception as e:  # the control process is gone: nobody can re-plan
                if "timeout" in str(e).lower():
                    continue
                print(f"nutp: rank slot {self.slot}: control store lost ({e}); exiting",
                      flush=True)
                os._exit(3)
            if why.startswith(GROW):
                with self._lock:  # not once this rank has left world ``gen`` (a boundary
                    if self.gen == gen:  # it stopped at by itself: a straggler excluded)
                        self._grow.set()
            else:
                backend.FLAG.set(why)
            self._rejoined.wait()
            self._rejoined.clear()
            gen += 1

    # -- the step's protocol ---------------------------------------------------------------

    def begin(self, step: int) -> None:
        self.step, self.phase = step, "compute"
        self.began = time.perf_counter()

    def vote(self, loss: float) -> None:
        """After the gradient reduction (global ``loss`` in hand), before any optimizer state
        changes: one all-reduce over the world; the step is committed when it returns the
        world size."""
        self.loss = loss
        self.phase = "voting"
        # [1, grow]: a grow-back request seen by any rank's control thread before its vote
        # stops every rank after this step (the sum is the same on every rank).
        t = torch.tensor([1, int(self._grow.is_set())], dtype=torch.int32)
        dist.all_reduce(t)
        if int(t[0]) != dist.get_world_size():
            raise RuntimeError(f"vote of step {self.step}: {int(t[0])} of "
                               f"{dist.get_world_size()} ranks")
        self.grow_agreed = int(t[1]) > 0
        self.phase = "committed"
        self.committed = Committed(self.step, loss, step_s=time.perf_counter() - self.began)

    def stepped(self, grad_norm: float | None) -> None:
        self.committed.grad_norm = grad_norm

    # -- stopping ------------------------------------------------------------------------

    def stop(self, error: BaseException) -> tuple[Report, float]:
        """Called with the error that ended this rank's step: wait for the abort, report.
        Returns the report and when this rank got out of the step."""
        out_at = time.time()
        deadline = time.monotonic() + ABORT_WAIT_S
        while not backend.FLAG.is_set():
            if time.monotonic() > deadline:
                raise error  # no abort: an ordinary error of this rank
            time.sleep(0.005)
        rep = Report(self.step, self.phase)
        self.store.set(f"report{self.gen}/{self.slot}", json.dumps(
            {"step": rep.step, "phase": rep.phase, "out_at": out_at, "pid": os.getpid(),
             "error": f"{type(error).__name__}: {str(error)[:200]}"}))
        return rep, out_at

    def boundary(self) -> Report:
        """At the step boundary the vote agreed on (GPUs back): report the committed step."""
        rep = Report(self.step, "committed")
        self.store.set(f"report{self.gen}/{self.slot}", json.dumps(
            {"step": rep.step, "phase": rep.phase, "out_at": time.time(), "pid": os.getpid(),
             "error": ""}))
        return rep

    def decision(self) -> dict[str, Any]:
        key = f"decision{self.gen}"
        self.store.wait([key], timedelta(seconds=self.timeout_s))
        return dict(json.loads(self.store.get(key)))

    def rejoin(self, *, rank: int, world: int, device: torch.device | None) -> None:
        """Leave the old world, join the next one (the control thread then watches its
        abort key)."""
        backend.abandon()
        backend.FLAG.clear()
        with self._lock:
            self._grow.clear()
            self.grow_agreed = False
            self.gen += 1
        self._rejoined.set()
        backend.join(self.store, gen=self.gen, rank=rank, world=world,
                     backend="nccl" if device is not None and device.type == "cuda"
                     else "gloo", timeout_s=self.timeout_s)

    def post(self, key: str, value: dict[str, Any]) -> None:
        self.store.set(f"{key}{self.gen}", json.dumps(value))


def is_stop(error: BaseException) -> bool:
    """Whether a step's error may be a stopped world (then ``LiveRank.stop`` decides)."""
    return isinstance(error, (backend.Aborted, RuntimeError, dist.DistBackendError))


def move(old: Any | None, new: Any, *, old_plan: Plan, rank_map: dict[int, int],
         joiners: frozenset[int] = frozenset(), dead: frozenset[int] = frozenset()
         ) -> dict[str, Any]:
    """Move the old session's state into the new one (collective over the new world;
    ``old=None``: this rank joins with nothing; ``dead``: the old world's ranks that take no
    part: dead, or left out by the new plan). Returns
    this rank's figures: bytes received, its lower bound, peak memory ratio, seconds."""
    from ..relayout.move import MoveImpossible, experts_of, move_state
    from ..relayout.plan import plan_move

    if getattr(new.optimizer, "nutp_zero", False):  # by slices (recovery.live_redundancy)
        from ..relayout.zero_move import move_zero

        if old is None:
            raise MoveImpossible("a joiner under the distributed optimizer (grow back takes "
                                 "the restart path)")
        return move_zero(old.optimizer, new.optimizer, dead=dead, stage=old.groups.ctx.stage,
                         new_stage=new.groups.ctx.stage)

    prec = getattr(new, "precision", "fp32")
    per_elem = 12 if prec == "fp32" else 14
    mv = plan_move(old_plan, new.plan, rank_map, bytes_per_elem=per_elem, joiners=joiners,
                   experts=experts_of(new))  # MoE: experts move whole, as units
    rep = move_state(mv, old=old, new=new, group=dist.group.WORLD)
    return {"received_bytes": int(rep.received_bytes),
            "lower_bound_bytes": int(rep.lower_bound_bytes),
            "peak_memory_ratio": float(rep.peak_memory_ratio), "move_s": float(rep.seconds)}


def reduce_max(values: list[float], device: torch.device | None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]
