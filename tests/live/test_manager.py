"""The live re-layout's rank side is one object the loop calls (``live.manager.LiveManager``),
and nothing replaces a method of a session, its model or its optimizer at run time: the manager
becomes the session's step listener, test faults ride on torch module hooks and the distributed
optimizer's ``before_publish`` hook. Pure: no process group (the link is a stand-in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from nemo_nutp.common.faults import Fault, Faults
from nemo_nutp.live.link import Committed
from nemo_nutp.live.manager import LiveManager


@dataclass
class StandInLink:
    """What ``LiveManager`` uses of a ``LiveLink``, recording the calls."""

    slot: int = 0
    gen: int = 0
    step: int = 0
    loss: float = float("nan")
    began: float = 0.0
    committed: Committed = field(default_factory=Committed)
    store: Any = None
    timeout_s: float = 1.0
    injector: Any = None
    old_replica_tp: Any = None
    grow_agreed: bool = False
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def begin(self, step: int) -> None:
        self.step = step
        self.calls.append(("begin", step))

    def vote(self, loss: float) -> None:
        self.calls.append(("vote", loss))

    def stepped(self, grad_norm: float | None) -> None:
        self.calls.append(("stepped", grad_norm))


class StandInOptimizer:
    def __init__(self) -> None:
        self.before_publish: Any = None

    def step_with_ready_grads(self) -> bool:
        return True


class StandInModel(torch.nn.Module):
    def finish_grad_sync(self) -> None:
        pass


def _session() -> Any:
    gpt = torch.nn.Linear(2, 2)
    return SimpleNamespace(gpt=gpt, model=StandInModel(), optimizer=StandInOptimizer(),
                           listener=None)


def _methods(obj: Any) -> dict[str, Any]:
    """The bound methods an object answers with now (instance attributes shadowing a class's
    method would show as a different function)."""
    names = [n for n in dir(obj) if not n.startswith("__") and callable(getattr(obj, n, None))]
    return {n: getattr(getattr(obj, n), "__func__", getattr(obj, n)) for n in names}


def test_attach_makes_the_manager_the_listener_and_swaps_no_method() -> None:
    link = StandInLink()
    manager = LiveManager(SimpleNamespace(), link, SimpleNamespace(), device=None)  # type: ignore[arg-type]
    session = _session()
    run = SimpleNamespace(session=session)
    before = {k: _methods(getattr(session, k)) for k in ("model", "optimizer", "gpt")}
    attrs = dict(vars(session))
    manager.attach(run)  # type: ignore[arg-type]
    assert session.listener is manager
    assert {k: v for k, v in vars(session).items() if k != "listener"} == \
        {k: v for k, v in attrs.items() if k != "listener"}
    assert {k: _methods(getattr(session, k)) for k in ("model", "optimizer", "gpt")} == before
    # the listener's calls reach the link: the vote, the committed step's norm (None: skipped)
    manager.begin(4)
    manager.vote(2.5)
    manager.stepped(SimpleNamespace(skipped=False, grad_norm=0.75))
    manager.stepped(SimpleNamespace(skipped=True, grad_norm=float("nan")))
    assert link.calls == [("begin", 4), ("vote", 2.5), ("stepped", 0.75), ("stepped", None)]
    assert manager.boundary_due(None) is False and manager.boundary_due({3: 0.5}) is True


def test_faults_ride_on_hooks_not_on_replaced_methods() -> None:
    """An armed injector fires each phase where the step reports it: forward/backward through
    torch module hooks, sync/vote/optimizer through the manager, gather through the optimizer's
    ``before_publish``; the model's and optimizer's methods stay the class's."""
    fired: list[str] = []

    class Recording(Faults):
        def fire(self, phase: str, *, rank: int, step: int, gen: int) -> None:
            fired.append(phase)

    link = StandInLink(injector=Recording([Fault("kill", 0, 0, "sync", 0)]))
    manager = LiveManager(SimpleNamespace(), link, SimpleNamespace(), device=None)  # type: ignore[arg-type]
    session = _session()
    before = {k: _methods(getattr(session, k)) for k in ("model", "optimizer")}
    manager.attach(SimpleNamespace(session=session))  # type: ignore[arg-type]
    after = {k: _methods(getattr(session, k)) for k in ("model", "optimizer")}
    assert {k: {n: after[k][n] for n in before[k]} for k in before} == before
    assert callable(session.optimizer.before_publish)  # a declared hook, None until armed
    session.gpt(torch.ones(1, 2, requires_grad=True)).sum().backward()
    manager.phase("sync")
    manager.vote(1.0)
    manager.phase("optimizer")
    session.optimizer.before_publish()
    assert fired == ["forward", "backward", "sync", "vote", "optimizer", "gather"]
