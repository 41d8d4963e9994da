"""Fault injection for tests and demos: one grammar, one place that fires.

A fault (``Fault``) is: ``kind`` kill (SIGKILL), hang (sleep forever), save_crash (SIGKILL
inside a save), slow (a straggler) or slow_link (a slow NIC); ``rank``, the global rank in the
first world (for a phase fault the process's *slot*: its rank in world 0, its identity through
live re-layouts); ``step`` (0-based); ``phase`` (None: the start of the step; else one of
``PHASES``, kill and hang only, under ``recovery.mode=live``); ``gen``, the world of a phase
fault (0: the first, 1: after one live re-layout, ...); ``factor`` and ``until`` (slow only:
from ``step`` on, up to but not including step ``until``, None: to the end, the rank sleeps
``factor - 1`` times the measured forward/backward time of each of its micro-batches, so its
compute takes ``factor`` x the wall time; see ``train/step.py``; slow_link: from ``step`` up to
``until`` the cross-domain traffic of the GPU that ``rank`` has in the first world takes
``factor`` x as long: every data-path op on a group that spans scale-up domains with that GPU in
it, under ``cluster.emulated_scale_out_mb_s``; keyed by the GPU, so it survives a live
re-layout: ``parallel/comm.py``).

When each fires: kill/hang without a phase at the start of step ``step`` of the first world
(``train/loop.py`` drops them after a live re-layout); with a phase, once, when this slot reaches
that phase of step ``step`` in world ``gen`` — ``relayout`` fires inside the re-layout that leaves
world ``gen`` (after the control process's decision, before the rank joins the next world: a
second failure), whatever ``step``;
save_crash in the first save of a checkpoint with step >= ``step``, after this rank's shards are
written and before the checkpoint is marked complete.

Given by the config (``recovery.fault.*``: one fault, ``kind: null`` none; ``recovery.faults``: a
list of the same mappings, e.g. ``recovery.faults=[{kind:kill,rank:1,step:2},{kind:slow,rank:0,
factor:2}]``) or, for launchers that cannot pass config, by the environment, which wins::

    NUTP_FAULT=kill:rank=1:step=2,hang:rank=3:step=4:phase=vote:gen=1,slow:rank=0:factor=2:until=9

(faults separated by commas; each a kind, then ``field=value`` parts, in any order). Deprecated
for one release, each parsed to the same ``Fault`` with one warning line on stderr: the old
positional forms ``NUTP_FAULT=kill|hang|save_crash:RANK:STEP``,
``NUTP_FAULT=slow:RANK:FACTOR[:STEP]`` and ``NUTP_LIVE_FAULT=kill|hang:SLOT:STEP:PHASE[:GEN]``
(its faults are added to the others').
A fault acts in one attempt of the restart path: ``attempt`` (default 0, the first;
``NUTP_ATTEMPT``, the CPU supervisor's or the ``nutp sbatch`` srun loop's attempt number), so a
restarted world runs through unless a fault names its attempt (tests of several restarts in one
job, e.g. ``slow:rank=1:factor=4:attempt=2``); never in a run Slurm requeued or an agent
resubmitted.

Events (``common/events.py``): a fatal fault logs ``FATAL_EVENT`` ("fault": kind, rank, step,
pid; phase and gen for a phase fault) just before it acts — failure detection and the transition
timers (``health/watch.py``, ``benchmarks/transition_cost.py``) time from it; a slowdown logs
``SLOW_EVENT`` ("slow_fault": rank, step, factor, until) at its first step instead, never the
fatal one, since nothing dies; a slow link logs ``SLOW_LINK_EVENT`` ("slow_link_fault": gpu,
rank, step, factor, until) at its first step, on the rank holding the GPU then.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .env import ATTEMPT, FAULT, LIVE_FAULT, requeued
from .events import log_event

KINDS = ("kill", "hang", "save_crash", "slow", "slow_link")
SLOWDOWNS = ("slow", "slow_link")  # kinds with a factor and an end step
FATAL = ("kill", "hang", "save_crash")
PHASES = ("forward", "backward", "sync", "vote", "optimizer", "gather", "relayout")
"""``gather``: the distributed optimizer only, after the update of its slices, before their
parameter all-gather."""
FATAL_EVENT = "fault"
SLOW_EVENT = "slow_fault"
SLOW_LINK_EVENT = "slow_link_fault"
_SPEC = ("each fault is KIND[:FIELD=VALUE...] (KIND kill|hang|save_crash|slow|slow_link; FIELD "
         "rank, step, phase, gen, factor, until, attempt), faults separated by commas")


@dataclass(frozen=True)
class Fault:
    """One injected fault (module docstring); a bad field: ValueError ``field=value: why``."""

    kind: str
    rank: int
    step: int = 0
    phase: str | None = None
    gen: int = 0
    factor: float = 1.0
    until: int | None = None
    attempt: int = 0

    def __post_init__(self) -> None:
        why = self._problem()
        if why is not None:
            raise ValueError(f"{why[0]}={getattr(self, why[0])!r}: {why[1]}")

    def _problem(self) -> tuple[str, str] | None:
        if self.kind not in KINDS:
            return "kind", "must be kill, hang, save_crash, slow or slow_link"
        for name in ("rank", "step", "gen", "attempt"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                return name, "must be an integer >= 0"
        if self.phase is not None:
            if self.phase not in PHASES:
                return "phase", f"must be one of {', '.join(PHASES)} (or none: step start)"
            if self.kind not in ("kill", "hang"):
                return "phase", f"a {self.kind} fault has no phase (kill and hang only)"
        elif self.gen != 0:
            return "gen", "a fault at a step's start fires in the first world (gen 0) only"
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)):
            return "factor", "must be a number"
        if self.kind in SLOWDOWNS:
            if not 1.0 <= self.factor < 1e6:
                return "factor", "must be >= 1"
            if self.until is not None and (not isinstance(self.until, int) or isinstance(
                    self.until, bool) or self.until <= self.step):
                return "until", f"must be an integer > step ({self.step}), or none: forever"
        else:
            if self.factor != 1.0:
                return "factor", "only a slow or slow_link fault has a factor"
            if self.until is not None:
                return "until", "only a slow or slow_link fault has an end step"
        return None

    @property
    def fatal(self) -> bool:
        return self.kind in FATAL

    def slow_factor(self, rank: int, step: int) -> float:
        """Compute wall-time multiplier of ``rank`` at ``step`` (1.0: not slowed)."""
        if (self.kind == "slow" and rank == self.rank and step >= self.step
                and (self.until is None or step < self.until)):
            return self.factor
        return 1.0


def parse(spec: str, *, name: str = FAULT) -> list[Fault]:
    """The faults of an environment spec (module docstring); ValueError, one line naming
    ``name`` (the variable) and the spec."""
    out: list[Fault] = []
    old = False
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            f, was_old = _parse_one(part, live=name == LIVE_FAULT)
        except ValueError as e:
            raise ValueError(f"{name}={spec!r}: {part!r}: {e}; {_SPEC}") from None
        out.append(f)
        old = old or was_old
    if not out:
        raise ValueError(f"{name}={spec!r}: no fault; {_SPEC}")
    if old:
        _deprecated(name, spec)
    return out


_warned: set[str] = set()


def _deprecated(name: str, spec: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    print(f"warning: {name}={spec!r}: positional fault specs are deprecated (removed in the next "
          f"release); write {FAULT}=KIND:rank=R:step=S[:phase=P:gen=G][:factor=F:until=U]",
          file=sys.stderr, flush=True)


_INTS = ("rank", "step", "gen", "until", "attempt")


def _parse_one(part: str, *, live: bool) -> tuple[Fault, bool]:
    kind, *rest = part.split(":")
    if rest and all("=" in r for r in rest):
        kw: dict[str, Any] = {}
        known = {f.name for f in fields(Fault)} - {"kind"}
        for r in rest:
            k, _, v = r.partition("=")
            if k not in known:
                raise ValueError(f"unknown field {k!r}")
            if k in kw:
                raise ValueError(f"field {k!r} given twice")
            kw[k] = _value(k, v)
        if "rank" not in kw:
            raise ValueError("rank=... missing")
        return Fault(kind, **kw), False
    if any("=" in r for r in rest):
        raise ValueError("mixes positional and field=value parts")
    if live:  # NUTP_LIVE_FAULT=kill|hang:SLOT:STEP:PHASE[:GEN]
        if len(rest) not in (3, 4) or kind not in ("kill", "hang"):
            raise ValueError("must be kill|hang:SLOT:STEP:PHASE[:GEN]")
        gen = _value("gen", rest[3]) if len(rest) == 4 else 0
        return Fault(kind, _value("rank", rest[0]), _value("step", rest[1]), rest[2], gen), True
    if kind in ("kill", "hang", "save_crash") and len(rest) == 2:
        return Fault(kind, _value("rank", rest[0]), _value("step", rest[1])), True
    if kind == "slow" and len(rest) in (2, 3):
        step = _value("step", rest[2]) if len(rest) == 3 else 0
        return Fault(kind, _value("rank", rest[0]), step, factor=_value("factor", rest[1])), True
    raise ValueError("must be KIND:field=value... (or the deprecated kill|hang|save_crash:RANK:"
                     "STEP, slow:RANK:FACTOR[:STEP])")


def _value(field: str, text: str) -> Any:
    try:
        if field in _INTS:
            return int(text)
        if field == "factor":
            return float(text)
    except ValueError:
        raise ValueError(f"{field}={text!r}: must be a number") from None
    return text


def from_config(fc: Any, key: str) -> Fault | None:
    """The fault of one ``recovery.fault``-shaped mapping (``config/schema.py``'s
    ``FaultConfig``; kind None: none); ValueError ``key.field=value: why``."""
    if fc.kind is None:
        return None
    slow = fc.kind in SLOWDOWNS
    try:
        return Fault(fc.kind, fc.rank, fc.step, fc.phase, fc.gen, fc.factor if slow else 1.0,
                     fc.until if slow else None, fc.attempt)
    except ValueError as e:
        raise ValueError(f"{key}.{e}") from None


def check_factor(fc: Any, key: str) -> None:
    """``factor`` has a default, so it is checked whatever the kind (``config/schema.py``)."""
    if not 1.0 <= fc.factor < 1e6:
        raise ValueError(f"{key}.factor={fc.factor!r}: must be >= 1")


def configured(recovery: Any) -> list[Fault]:
    """The faults of a ``recovery`` config: ``recovery.fault``, then ``recovery.faults``."""
    out = [from_config(recovery.fault, "recovery.fault")]
    out += [from_config(fc, f"recovery.faults[{i}]") for i, fc in enumerate(recovery.faults)]
    return [f for f in out if f is not None]


class Faults:
    """The faults of this process's job and the state of their firing. Methods take the rank
    asking (for phase faults: its slot) and act only on that rank's faults."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = tuple(faults)
        self.fired: set[Fault] = set()

    @classmethod
    def from_env_or_config(cls, cfg: Any) -> Faults | None:
        """The faults of ``$NUTP_FAULT`` (it wins) or else of the config's ``recovery``, plus the
        deprecated ``$NUTP_LIVE_FAULT``, those of this attempt (``NUTP_ATTEMPT``, unset: 0;
        a fault's ``attempt``); None in a run Slurm requeued (``env.requeued``: the faults fired
        in the first run) or without any. ``cfg``: a ``JobConfig`` (None: the environment
        only)."""
        if requeued():
            return None
        attempt = int(os.environ.get(ATTEMPT) or 0)
        spec = os.environ.get(FAULT)
        if spec:
            found = parse(spec)
        else:
            found = configured(cfg.recovery) if cfg is not None else []
        live = os.environ.get(LIVE_FAULT)
        if live:
            found += parse(live, name=LIVE_FAULT)
        found = [f for f in found if f.attempt == attempt]
        return cls(found) if found else None

    # -- start of a step, saves, the slowdown (train/loop.py, checkpoint/hooks.py, Bridge) ----

    def at_step(self, rank: int, step: int) -> None:
        """The start of ``step`` on ``rank``: kill/hang faults without a phase fire; a slowdown
        starting here logs ``SLOW_EVENT`` (the step applies it: ``slow_factor``)."""
        for f in self.faults:
            if f.rank != rank or f.step != step or f.phase is not None:
                continue
            if f.kind in ("kill", "hang"):
                self._fire(f, rank, step)
            elif f.kind == "slow":
                log_event(SLOW_EVENT, rank=rank, step=step, factor=f.factor, until=f.until,
                          pid=os.getpid())

    def in_save(self, rank: int, step: int) -> None:
        """Inside a save of checkpoint ``step`` (shards written, not yet complete)."""
        for f in self.faults:
            if f.kind == "save_crash" and f.rank == rank and step >= f.step:
                self._fire(f, rank, step)

    def slow_factor(self, rank: int, step: int) -> float:
        """Compute wall-time multiplier of ``rank`` at ``step`` (1.0: not slowed; the largest
        where several slowdowns overlap)."""
        return max((f.slow_factor(rank, step) for f in self.faults), default=1.0)

    def links(self) -> list[Fault]:
        """The slow_link faults (``parallel/comm.py`` applies them to every rank's ops)."""
        return [f for f in self.faults if f.kind == "slow_link"]

    # -- phases of a live step (live/link.py, live/manager.py) --------------------------------

    def fire(self, phase: str, *, rank: int, step: int, gen: int) -> None:
        """Slot ``rank`` reached ``phase`` of ``step`` in world ``gen``: its phase faults there
        fire, each once (``relayout``: whatever the step)."""
        for f in self.faults:
            if f.rank != rank or f.phase != phase or f.gen != gen or f in self.fired:
                continue
            if phase != "relayout" and f.step != step:
                continue
            self.fired.add(f)
            self._fire(f, rank, step, phase=phase, gen=gen)

    def arm(self, session: Any, rank: int, where: Callable[[], tuple[int, int]]) -> None:
        """Hook the phases of ``session`` (a ``train.session.RankSession``) that its step does
        not report itself: forward and backward (torch module hooks) and the distributed
        optimizer's ``gather`` (its ``before_publish`` hook). ``sync``, ``vote`` and
        ``optimizer`` come from the live manager, the session's step listener. ``where()``
        gives (step, gen) now; ``rank``: this process's slot. Nothing is hooked without a phase
        fault of this slot."""
        if not any(f.rank == rank and f.phase is not None for f in self.faults):
            return

        def at(phase: str) -> None:
            step, gen = where()
            self.fire(phase, rank=rank, step=step, gen=gen)

        # virtual pipeline stages: every chunk runs its own forward and backward
        for module in getattr(session.gpt, "chunks", [session.gpt]):
            module.register_forward_pre_hook(lambda *_: at("forward"))
            module.register_full_backward_pre_hook(lambda *_: at("backward"))
        if hasattr(session.optimizer, "before_publish"):  # slices updated, params not gathered
            session.optimizer.before_publish = lambda: at("gather")

    @staticmethod
    def _fire(f: Fault, rank: int, step: int, **where: Any) -> None:
        log_event(FATAL_EVENT, kind=f.kind, rank=rank, step=step, **where, pid=os.getpid())
        if f.kind == "hang":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)
