"""What a Megatron-Bridge (or Megatron-LM) checkpoint carries beyond ``nutp-train``'s own state,
and how ``nutp-train`` continues it. No process group; megatron's scheduler only evaluates a
saved schedule.

* **Parameter groups.** megatron's optimizer loader pairs saved with current parameter groups by
  a key tuple (``megatron.core.optimizer.optimizer.param_group_identifier_keys``). megatron-core
  0.16 keys on the structural fields (``wd_mult``, ``lr_mult``, ``is_expert_parallel``,
  ``is_decoupled_lr``); 0.17+ adds the scheduler's per-group fields (``max_lr``, ``min_lr``,
  ``start_wd``, ``end_wd``, ``optimizer``), which Bridge's optimizer sets from its scheduler
  config and ``nutp-train``'s (no scheduler) leaves unset, so no group matches.
  ``align_param_groups`` pairs the groups by the structural fields alone and gives each saved
  group the current group's scheduler fields; everything else (``lr``, ``weight_decay``,
  betas, eps, ``step``, the moments) loads from the checkpoint as megatron's loader does.
* **The schedule.** ``nutp-train``'s lr follows its own schedule (``train.lr_*``, in updates:
  ``train/schedule.py``) and its weight decay is constant; Bridge's ``OptimizerParamScheduler``
  (its state is in the checkpoint's ``extra["bridge"]["scheduler"]``, counted in samples) can
  change both at every step. ``check_continuation`` evaluates that schedule at every step
  ``nutp-train`` will run (``num_steps = step x train.global_batch_size``, as Bridge's loop
  steps it): the resume goes on only if it sets exactly ``nutp-train``'s lr and
  ``train.weight_decay`` at every one of them, so the run continues as Bridge's own would have;
  otherwise a ``ValueError`` naming the field (also where the checkpoint cannot tell: inside a
  warmup, whose start is not saved, or a WSD decay). The consumed-sample
  count must equal ``step x train.global_batch_size`` (the same data position).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

STRUCTURAL = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
"""megatron's own identifier keys of a parameter group (megatron-core 0.16)."""
SCHEDULE = ("max_lr", "min_lr", "start_wd", "end_wd", "optimizer")
"""The scheduler's per-group keys (``ParamGroupOverride``, megatron-core 0.17+)."""


def _get(group: dict[str, Any], key: str) -> Any:
    """A group's identifier value as megatron reads it (NeMo's ``pre_`` alias; missing: None)."""
    return group.get(key, group.get(f"pre_{key}"))


def _structure(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(_get(group, k) for k in STRUCTURAL)


def saved_param_groups(state: Any) -> list[list[dict[str, Any]]]:
    """Every ``param_groups`` list in a loaded optimizer state dict (one per optimizer of a
    chain; megatron's mixed-precision optimizers nest it under ``optimizer``)."""
    found: list[list[dict[str, Any]]] = []
    if isinstance(state, dict):
        groups = state.get("param_groups")
        if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
            found.append(groups)
        for key, value in state.items():
            if key != "param_groups":
                found += saved_param_groups(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            found += saved_param_groups(value)
    return found


def align_param_groups(current: list[dict[str, Any]], state: Any) -> int:
    """Give every saved group of ``state`` (a loaded optimizer state dict) the scheduler keys of
    the ``current`` groups with its structural key, where those agree; returns how many saved
    groups were changed. Groups without a structural match are left as they are (megatron's
    loader then names them)."""
    by_structure: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for group in current:
        by_structure.setdefault(_structure(group), []).append(group)
    changed = 0
    for groups in saved_param_groups(state):
        for saved in groups:
            mine = by_structure.get(_structure(saved), [])
            values = {tuple(_get(g, k) for k in SCHEDULE) for g in mine}
            if len(values) != 1:
                continue
            want = dict(zip(SCHEDULE, values.pop(), strict=True))
            if any(_get(saved, k) != v for k, v in want.items()):
                for k, v in want.items():
                    saved.pop(f"pre_{k}", None)
                    if v is None:
                        saved.pop(k, None)
                    else:
                        saved[k] = v
                changed += 1
    return changed


def _lr_at(s: dict[str, Any], n: int) -> tuple[float | None, str]:
    """The learning rate megatron's scheduler sets at ``num_steps = n`` when its
    ``state_dict`` determines it (None otherwise: in the warmup, whose start ``lr_warmup_init``
    is not saved, and in WSD's decay, whose length is not saved), and the field that
    decides. Evaluated by megatron's own ``OptimizerParamScheduler``."""
    warmup = int(s["lr_warmup_steps"])
    if warmup > 0 and n <= warmup:
        return None, "scheduler.lr_warmup_iters"
    if s["lr_decay_style"] == "constant":
        return float(s["max_lr"]), "optimizer.lr"
    if n > int(s["lr_decay_steps"]):
        return float(s["min_lr"]), "optimizer.min_lr"
    if s["lr_decay_style"] == "WSD":
        return None, "scheduler.lr_decay_style"
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sched = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[]), init_lr=0.0, max_lr=float(s["max_lr"]),
        min_lr=float(s["min_lr"]), lr_warmup_steps=warmup,
        lr_decay_steps=int(s["lr_decay_steps"]), lr_decay_style=s["lr_decay_style"],
        start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant")
    sched.num_steps = n
    return float(sched.get_lr({})), "scheduler.lr_decay_style"


def _wd_at(s: dict[str, Any], n: int) -> float:
    if n > int(s["wd_incr_steps"]) or s["wd_incr_style"] == "constant":
        return float(s["end_wd"])
    return math.nan  # increasing: never equal to a constant


def check_continuation(bridge: dict[str, Any], *, path: Any, step: int, steps: int,
                       global_batch: int, lr: float | Callable[[int], float],
                       weight_decay: float) -> None:
    """``bridge``: a checkpoint's ``extra["bridge"]`` (``consumed_train_samples``,
    ``scheduler``); ``step``: the saved step ``nutp-train`` starts at; ``steps``:
    ``train.steps``; ``lr``: ``nutp-train``'s constant lr, or its schedule (``lr(updates)``).
    ``ValueError`` naming the field unless Bridge's schedule sets ``nutp-train``'s lr and
    ``weight_decay`` at every step ``step .. steps-1`` and the data position agrees."""
    consumed = bridge.get("consumed_train_samples")
    if consumed is not None and int(consumed) != step * global_batch:
        raise ValueError(f"train.global_batch_size={global_batch}: checkpoint {path} was saved "
                         f"by Bridge after {consumed} samples in {step} steps (global batch "
                         f"{int(consumed) // max(step, 1)})")
    s = bridge.get("scheduler")
    if s is None:
        return
    for k in range(step, steps):
        n = k * global_batch
        have, field = _lr_at(s, n)
        if have is None:
            raise ValueError(
                f"{field}: checkpoint {path} continues Bridge's lr schedule "
                f"(lr_decay_style={s['lr_decay_style']}, warmup {s['lr_warmup_steps']} / decay "
                f"{s['lr_decay_steps']} samples) at step {k}, where its lr is not in the "
                f"checkpoint (nutp-train cannot check that its schedule continues it)")
        want, name = (lr(k), "train.lr_decay_style") if callable(lr) else (lr, f"train.lr={lr}")
        if not math.isclose(have, want, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(f"{name}: checkpoint {path} continues Bridge's schedule at "
                             f"lr {have} ({field}) at step {k}, nutp-train's schedule at {want}")
        wd = _wd_at(s, n)
        if not math.isclose(wd, weight_decay, rel_tol=1e-12, abs_tol=0.0):
            raise ValueError(f"train.weight_decay={weight_decay}: checkpoint {path} continues "
                             f"Bridge's weight-decay schedule (wd_incr_style="
                             f"{s['wd_incr_style']}, {s['start_wd']} -> {s['end_wd']}) at "
                             f"{wd} at step {k}")
