"""``nutp-bridge recovery.mode=live``: Bridge's own ``train()`` through live re-layouts.

The rank side is ``nutp-train``'s (``live.manager.LiveManager``, ``live/link.py``,
``relayout/``); this module gives it Bridge's objects. The manager asks a ``Trainer`` for a
world's session and run; here:

* ``BridgeTrainer.build(job, plan)`` is ``bridge_run.build_world`` (groups, the NUTP model in
  Bridge's chunk list, Bridge's optimizer and scheduler) on a fresh copy of the recipe's
  ``ConfigContainer``, seen through ``BridgeSession``, the face of ``train.session.RankSession``
  that the manager and ``relayout.move`` read (plan, groups, the NUTP DDP model, the unwrapped
  GPT, the optimizer, the lr schedule's clock, ``apply_update``);
* ``BridgeTrainer.make_run`` is ``bridge_run.start_world``: a new ``GlobalState`` at the step
  the new world starts (``ResumeAt``: the consumed samples and the scheduler where an
  uninterrupted run has them; no checkpoint is read), the data iterators from there, Bridge's
  callbacks, and the outputs continuing the goodput ledger and ``metrics.jsonl``.

How a step meets the manager (``bridge_run.StepHooks``, around megatron's ``optimizer.step``,
which Bridge's ``train_step`` calls after the gradient finalisation): the global-batch loss,
then the distributed optimizer's collectives before the vote (``before_vote``), the vote, the
``optimizer`` phase, the update; after it the step's outcome (``stepped``) and the schedule's
clock. Bridge's ``on_train_step_start`` callback is the manager's ``begin``; its
``on_train_step_end`` is where a grow-back boundary the vote agreed on leaves ``train()``
(``Boundary``, before Bridge counts the step: the next world starts after it).

Leaving ``train()``: a failed peer surfaces as gloo's error or the abort flag's ``Aborted``
inside any collective (``live/backend.py``); the exception propagates out of Bridge's
``train()`` (it catches none), and the survivors re-lay out in memory and call ``train()``
again at the committed step + 1. Never through Bridge's ``should_exit`` (``sys.exit``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class Boundary(Exception):
    """The vote agreed to stop after this step (GPUs are back), a straggler is to be
    excluded (``slow``: its GPU -> relative speed), or the slow-link watch asks for a sync
    re-layout (``links``: rank 0's slow NICs now, ``{}`` elsewhere): leave ``train()``."""

    def __init__(self, slow: dict[int, float] | None = None,
                 links: dict[int, float] | None = None) -> None:
        super().__init__("step boundary")
        self.slow, self.links = slow, links


class BridgeSession:
    """The face of ``train.session.RankSession`` a live re-layout reads, over a
    ``bridge_run.BridgeWorld``."""

    def __init__(self, world: Any) -> None:
        from megatron.core.transformer.module import Float16Module

        from .bridge_run import precision_of

        self.world = world
        self.plan, self.groups = world.plan, world.groups
        self.model = world.ddp  # the NUTP DDP
        self.optimizer = world.optimizer
        gpt = self.model.module
        self.gpt = gpt.module if isinstance(gpt, Float16Module) else gpt
        self.model_cfg = self.plan.request.model
        self.precision = precision_of(world.cfg)
        self.listener: Any = None
        self.skips, self.counted_through = 0, -1
        self.last_skipped: bool | None = None
        self.lrs: dict[int, float] = {}  # step -> the lr its update applied

    def count_step(self, step: int, skipped: bool) -> None:
        """``RankSession.count_step``: each step's outcome counted once."""
        if step > self.counted_through:
            self.counted_through = step
            self.skips += int(skipped)
            self.last_skipped = skipped

    def lr_of(self, step: int) -> float | None:
        """The lr a counted ``step`` updated with: recorded in this world, else Bridge's
        scheduler (in samples) at that step's clock (a re-layout's recovered metrics row)."""
        if step in self.lrs:
            return self.lrs[step]
        if step > self.counted_through:
            return None
        from ..train.schedule import lr_at_clock

        skips = self.skips
        if step == self.counted_through and self.last_skipped is not None:
            skips -= int(self.last_skipped)  # the clock that step ran at
        gbs = int(self.world.cfg.train.global_batch_size)
        return lr_at_clock(self.world.scheduler, (step - skips) * gbs)

    def apply_update(self, step: int) -> tuple[bool, float]:
        """Megatron's step from the gradients this rank holds (a voted step whose result was
        lost), without the run's wrappers: the lr is the one the step had."""
        self.lrs[step] = float(self.optimizer.param_groups[0]["lr"])
        ok, norm, _ = self.world.raw_step()
        self.count_step(step, not ok)
        return bool(ok), float("nan") if norm is None else float(norm)


class BridgeLiveRun:
    """``live.manager.Run`` of one world: Bridge's objects, rank 0's metrics, the ledger."""

    def __init__(self, trainer: BridgeTrainer, job: Any, plan: Any, session: BridgeSession, *,
                 start: int | None, ledger: Any, same_world: bool = False,
                 balance: Any = None) -> None:
        from .bridge_run import ResumeAt, StepHooks, start_world

        self.trainer, self.cfg, self.plan = trainer, job, plan
        self.session: BridgeSession | None = session
        hooks = StepHooks(before=self._before, after=self._after)
        resume = None
        if start is not None:  # owed: due at ``start`` and seen done by no rank (a joiner
            cfg = session.world.cfg  # sees nothing; the same world has not run it)
            owed = ResumeAt.evaluates_at(cfg, start) and (
                same_world or not _done_anywhere(trainer.evaluated >= start))
            resume = ResumeAt(start, session.skips, same_world=same_world, eval_pending=owed)
        self.run = start_world(session.world, trainer.out_dir, resume=resume, ledger=ledger,
                               hooks=hooks, balance=balance, callbacks_extra=self._callbacks,
                               links=trainer.links, watch=trainer.watch)
        trainer.links, trainer.watch = self.run.links, self.run.outputs.link_watch()
        self.start = self.run.first_step

    @property
    def out(self) -> Any:
        return self.run.outputs.out

    @property
    def ledger(self) -> Any:
        return self.run.outputs.ledger

    def _step(self) -> int:
        return int(self.run.state.train_state.step)

    def _before(self, loss: float) -> None:
        session = self.session
        assert session is not None and session.listener is not None
        pre = getattr(session.optimizer, "before_vote", None)
        if pre is not None:  # the distributed optimizer: its collectives before the vote
            pre()
        session.listener.vote(loss)
        session.lrs[self._step()] = float(session.optimizer.param_groups[0]["lr"])
        session.listener.phase("optimizer")

    def _after(self, ok: bool, grad_norm: float | None) -> None:
        session = self.session
        assert session is not None and session.listener is not None
        session.count_step(self._step(), not ok)
        norm = None if grad_norm is None or math.isnan(grad_norm) else grad_norm
        session.listener.stepped(SimpleNamespace(skipped=not ok, grad_norm=norm))

    def _callbacks(self, callbacks: Any, state: Any) -> None:
        manager, iters = self.trainer.manager, int(state.cfg.train.train_iters)

        def begin(ctx: Any) -> None:
            manager.begin(int(ctx.state.train_state.step))

        def end(ctx: Any) -> None:  # after the outputs' row and the shares (registered
            slow = self.run.balance.exclusion()  # before this)
            links = self.run.outputs.relayout_due()  # the same on every rank
            if ((manager.boundary_due(slow) or links is not None)
                    and int(ctx.state.train_state.step) + 1 < iters):
                raise Boundary(slow, links)

        callbacks.register("on_train_step_start", begin)
        callbacks.register("on_train_step_end", end)

    def train(self) -> None:
        from .bridge_run import train_world

        train_world(self.run)

    def reshared(self) -> BridgeLiveRun:
        """The same world re-entered at its new shares from the next step (``Reshare``)."""
        self.run.outputs.suspend()
        self._seen()
        assert self.session is not None
        return BridgeLiveRun(self.trainer, self.cfg, self.plan, self.session,
                             start=self.run.next_step(), ledger=self.ledger, same_world=True,
                             balance=self.run.balance)

    def _seen(self) -> None:
        if self.run.evals:
            self.trainer.evaluated = max(self.trainer.evaluated,
                                         int(self.run.evals[-1]["step"]))

    def close(self) -> None:
        """The world stopped: rank 0's pending row (a step whose end callback ran) is written
        before the manager closes the metrics file; which evaluations this process saw
        complete (the next world runs one the stopped world owed)."""
        self.run.outputs._flush()
        self._seen()


class BridgeTrainer:
    """``live.manager.Trainer`` for Bridge's ``train()`` (module docstring). ``job``: the
    ``BridgeJob`` as loaded (its ``ConfigContainer`` copied for every world, as the recipe and
    overrides give it)."""

    def __init__(self, job: Any, out_dir: str | Path, *, seed: int) -> None:
        self.job, self.out_dir, self.seed = job, str(out_dir), seed
        self.pristine = copy.deepcopy(job.bridge)
        self.manager: Any = None
        self.evaluated = -1  # the newest evaluation (Bridge's step counter) this process saw
        self.links: Any = None  # slow_link faults keyed by GPU, from the first world's plan
        self.watch: Any = None  # rank 0's slow-link watch, carried into the next world

    def build(self, job: Any, plan: Any) -> BridgeSession:
        from .bridge_run import build_world

        bridge_job = dataclasses.replace(self.job, bridge=copy.deepcopy(self.pristine), nutp=job)
        return BridgeSession(build_world(bridge_job, plan, seed=self.seed))

    def make_run(self, job: Any, plan: Any, session: BridgeSession, *,
                 start: int | None = None, ledger: Any = None) -> BridgeLiveRun:
        return BridgeLiveRun(self, job, plan, session, start=start, ledger=ledger)


def _done_anywhere(done: bool) -> bool:
    """Whether any rank of the new world saw it done (one all-reduce; a joiner saw nothing)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(done)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0])


def train_rank_live(job: Any, plan: Any, out_dir: str | Path, *, seed: int, link: Any,
                    joining: int | None = None) -> None:
    """This rank's whole job under the live control process (``link``), through any number of
    re-layouts; ``joining``: this process is a returning GPU's (its id; ``plan`` the stopped
    world's). Rank 0 of the last world writes the outputs; every rank of it its
    ``bridge_rank<r>.json`` (steps of that world)."""
    from ..live.manager import LiveManager
    from .bridge_run import Reshare, rank_record

    trainer = BridgeTrainer(job, out_dir, seed=seed)
    # BridgeSession is RankSession's face, not a subclass: the manager's Run protocol names
    # RankSession, so the manager is typed loosely here
    manager: Any = LiveManager(job.nutp, link, trainer,  # type: ignore[arg-type]
                               device=None)
    trainer.manager = manager
    if joining is not None:
        run, _ = manager.join(plan, joining)
    else:
        run = trainer.make_run(job.nutp, plan, trainer.build(job.nutp, plan))
        manager.attach(run)
    runs = [run]  # this world's (its shares changed between them)
    while True:
        try:
            run.train()
            break
        except Reshare:
            run = run.reshared()
            runs.append(run)
            continue
        except Boundary as b:
            run.close()
            run, _ = manager.relayout(run, None, slow=b.slow, links=b.links)
        except Exception as e:
            if not manager.is_stop(e):
                raise
            run.close()
            run, _ = manager.relayout(run, e)
        runs = [run]
    manager.final_check(run)  # tests only (NUTP_LIVE_DIGEST)
    run.run.outputs.finish()
    rank_record([r.run for r in runs], out_dir)
