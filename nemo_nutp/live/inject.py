"""Fault injection at each phase of a step, for the live path's tests and demos.

``NUTP_LIVE_FAULT=kind:SLOT:STEP:PHASE[:GEN]`` (several separated by commas): ``kind`` kill
(SIGKILL) or hang (sleep forever); ``SLOT`` the process's rank in world 0 (its identity through
re-layouts); ``PHASE`` one of ``PHASES``; ``GEN`` the world (0: the first, 1: after one live
re-layout, ...; default 0). ``relayout`` fires inside the re-layout that leaves world ``GEN``
(after the control process's decision, before the rank joins the next world: a second
failure), whatever ``STEP``. Each fault fires
once, in the supervisor's first attempt only (a restart runs through). ``NUTP_FAULT``
(``checkpoint/faults.py``: start of a step, or inside a save) keeps working in world 0.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common.env import ATTEMPT, LIVE_FAULT
from ..common.events import log_event

if TYPE_CHECKING:
    from ..train.session import RankSession

PHASES = ("forward", "backward", "sync", "vote", "optimizer", "gather", "relayout")
"""``gather``: the distributed optimizer only, after the update of its slices, before their
parameter all-gather."""


@dataclass(frozen=True)
class PhaseFault:
    kind: str
    slot: int
    step: int
    phase: str
    gen: int = 0


def parse(spec: str) -> list[PhaseFault]:
    """Faults of ``NUTP_LIVE_FAULT``; ValueError naming it."""
    out = []
    for part in filter(None, spec.split(",")):
        f = part.split(":")
        try:
            if len(f) not in (4, 5) or f[0] not in ("kill", "hang") or f[3] not in PHASES:
                raise ValueError(part)
            out.append(PhaseFault(f[0], int(f[1]), int(f[2]), f[3],
                                  int(f[4]) if len(f) == 5 else 0))
        except ValueError:
            raise ValueError(f"{LIVE_FAULT}={spec!r}: each fault must be "
                             f"kill|hang:SLOT:STEP:PHASE[:GEN], PHASE in {PHASES}") from None
    return out


class Injector:
    def __init__(self, slot: int, faults: list[PhaseFault]) -> None:
        self.slot = slot
        self.faults = [f for f in faults if f.slot == slot]
        self.fired: set[PhaseFault] = set()

    @classmethod
    def from_env(cls, slot: int) -> Injector | None:
        spec = os.environ.get(LIVE_FAULT)
        if not spec or os.environ.get(ATTEMPT, "0") not in ("", "0"):
            return None  # like NUTP_FAULT: the first attempt only (a restart runs through)
        return cls(slot, parse(spec))

    def fire(self, phase: str, *, step: int, gen: int) -> None:
        for f in self.faults:
            if f in self.fired or f.phase != phase or f.gen != gen:
                continue
            if phase != "relayout" and f.step != step:
                continue
            self.fired.add(f)
            log_event("fault", kind=f.kind, rank=self.slot, step=step, phase=phase, gen=gen,
                      pid=os.getpid())
            if f.kind == "hang":
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)

    def arm(self, session: RankSession, where: Callable[[], tuple[int, int]]) -> None:
        """Hook the phases of ``session`` that its step does not report itself: forward and
        backward (torch module hooks) and the distributed optimizer's ``gather`` (its
        ``before_publish`` hook). ``sync``, ``vote`` and ``optimizer`` come from the live
        manager, the session's step listener. ``where()`` gives (step, gen) now."""
        def at(phase: str) -> None:
            step, gen = where()
            self.fire(phase, step=step, gen=gen)

        # virtual pipeline stages: every chunk runs its own forward and backward
        for module in getattr(session.gpt, "chunks", [session.gpt]):
            module.register_forward_pre_hook(lambda *_: at("forward"))
            module.register_full_backward_pre_hook(lambda *_: at("backward"))
        if hasattr(session.optimizer, "before_publish"):  # slices updated, params not gathered
            session.optimizer.before_publish = lambda: at("gather")
