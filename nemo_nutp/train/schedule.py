"""``nutp-train``'s learning-rate and weight-decay schedule: megatron-core's own
``OptimizerParamScheduler`` under megatron's names (``train.lr_warmup_iters``,
``train.lr_decay_style``, ``train.lr_decay_iters``, ``train.min_lr``, ...).

The schedule's clock is the number of *successful* updates, as in Megatron-LM's and Bridge's
loops (a step skipped for an fp16 overflow does not advance it). Instead of an increment per
step, which a failure between the update and the increment would lose, a session counts the
skipped steps (``RankSession.skips``, checkpointed and carried through live re-layouts) and sets
the clock to ``step - skips`` before every step (``Schedule.at``): the same on every rank,
whatever happened to the previous world.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


@dataclass(frozen=True)
class Schedule:
    """The schedule's settings (``schedule_of(train)``); the lr is in updates, not samples."""

    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    warmup_init: float = 0.0
    decay_style: str = "constant"
    decay_iters: int = 1
    wsd_decay_style: str = "exponential"
    wsd_decay_iters: int | None = None
    weight_decay: float = 0.0

    def scheduler(self, optimizer: Any) -> Any:
        """megatron's ``OptimizerParamScheduler`` over ``optimizer``'s parameter groups (it sets
        each group's ``lr`` and ``weight_decay x wd_mult`` at construction and at every
        ``at``)."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        return OptimizerParamScheduler(
            optimizer, init_lr=self.warmup_init, max_lr=self.lr, min_lr=self.min_lr,
            lr_warmup_steps=self.warmup_iters, lr_decay_steps=self.decay_iters,
            lr_decay_style=self.decay_style, start_wd=self.weight_decay,
            end_wd=self.weight_decay, wd_incr_steps=self.decay_iters,
            wd_incr_style="constant", wsd_decay_steps=self.wsd_decay_iters,
            lr_wsd_decay_style=self.wsd_decay_style)

    def lr_at(self, updates: int) -> float:
        """The lr after ``updates`` successful updates (no optimizer needed)."""
        s = self.scheduler(SimpleNamespace(param_groups=[]))
        s.num_steps = updates
        return float(s.get_lr({}))


def schedule_of(train: Any) -> Schedule:
    """A ``train`` config section's schedule (``lr_decay_iters`` null: ``steps``)."""
    return Schedule(lr=train.lr, min_lr=train.min_lr, warmup_iters=train.lr_warmup_iters,
                    warmup_init=train.lr_warmup_init, decay_style=train.lr_decay_style,
                    decay_iters=train.lr_decay_iters or train.steps,
                    wsd_decay_style=train.lr_wsd_decay_style,
                    wsd_decay_iters=train.lr_wsd_decay_iters, weight_decay=train.weight_decay)


def set_clock(scheduler: Any, updates: int) -> float:
    """Put ``scheduler`` at ``updates`` successful updates and write the lr and weight decay
    into its optimizer's groups; returns the lr."""
    scheduler.num_steps = updates
    scheduler.step(0)
    return float(scheduler.get_lr({}))


def lr_at_clock(scheduler: Any, updates: int) -> float:
    """``scheduler``'s lr at ``updates`` successful updates, its state unchanged."""
    saved = scheduler.num_steps
    scheduler.num_steps = updates
    try:
        return float(scheduler.get_lr({}))
    finally:
        scheduler.num_steps = saved
