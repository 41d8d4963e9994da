"""``nemo_nutp.checkpoint.bridge_state``: a Bridge checkpoint's parameter groups and schedule in
``nutp-train`` (pure; the end-to-end resume is ``tests/integrations/test_bridge_train.py``)."""

from __future__ import annotations

import copy

import pytest

from nemo_nutp.checkpoint.bridge_state import align_param_groups, check_continuation


def _group(wd_mult: float, **schedule: object) -> dict[str, object]:
    return {"params": [0, 1], "lr": 1e-3, "weight_decay": 0.0, "wd_mult": wd_mult,
            "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, **schedule}


def _megatron_key(g: dict[str, object]) -> tuple[object, ...]:
    """megatron-core 0.17+'s identifier of a group (``param_group_identifier_keys``)."""
    keys = ("end_wd", "max_lr", "min_lr", "optimizer", "start_wd", "wd_mult", "lr_mult",
            "is_expert_parallel", "is_decoupled_lr")
    return tuple(g.get(k) for k in keys)


def test_bridge_groups_take_nutp_trains_schedule_keys() -> None:
    current = [_group(1.0, max_lr=1e-3), _group(0.0, max_lr=1e-3)]  # nutp-train: no min_lr
    saved = {"param_groups": [_group(0.0, max_lr=1e-3, min_lr=1e-4, start_wd=0.1),
                              _group(1.0, max_lr=1e-3, min_lr=1e-4, start_wd=0.1)],
             "state": {0: {"exp_avg": 1}}}
    before = copy.deepcopy(saved)
    assert {_megatron_key(g) for g in current} != {_megatron_key(g) for g in
                                                    saved["param_groups"]}  # the bug
    assert align_param_groups(current, {"optimizer": saved}) == 2  # nested (Float16 form)
    assert {_megatron_key(g) for g in current} == {_megatron_key(g) for g in
                                                   saved["param_groups"]}
    for got, was in zip(saved["param_groups"], before["param_groups"], strict=True):
        assert got["wd_mult"] == was["wd_mult"] and got["params"] == was["params"]
        assert "min_lr" not in got and "start_wd" not in got and got["max_lr"] == 1e-3
        assert got["lr"] == was["lr"]  # hyper-parameters still load from the checkpoint
    assert saved["state"] == before["state"]


def test_groups_without_a_structural_match_are_left_for_megatron_to_name() -> None:
    current = [_group(1.0), _group(1.0, max_lr=5e-4)]  # two groups, different schedules
    saved = [{"param_groups": [_group(1.0, min_lr=1e-4)]},
             {"param_groups": [_group(0.5, min_lr=1e-4)]}]  # a chain of two optimizers
    before = copy.deepcopy(saved)
    assert align_param_groups(current, saved) == 0
    assert saved == before


CONSTANT = {"max_lr": 1e-3, "min_lr": 1e-3, "lr_warmup_steps": 0, "num_steps": 18,
            "lr_decay_style": "constant", "lr_decay_steps": 60, "start_wd": 0.0,
            "end_wd": 0.0, "wd_incr_style": "constant", "wd_incr_steps": 60}


def _check(scheduler: dict[str, object] | None, *, consumed: int = 18, lr: float = 1e-3,
           wd: float = 0.0, steps: int = 5) -> None:
    check_continuation({"consumed_train_samples": consumed, "scheduler": scheduler},
                       path="ck/iter_0000003", step=3, steps=steps, global_batch=6, lr=lr,
                       weight_decay=wd)


def test_a_constant_schedule_continues_at_train_lr() -> None:
    _check(CONSTANT)
    _check(None)  # no scheduler saved: nothing to continue
    # past warmup and decay: megatron's scheduler sets min_lr from here on
    _check({**CONSTANT, "lr_decay_style": "cosine", "lr_warmup_steps": 6,
            "lr_decay_steps": 12, "min_lr": 1e-4}, lr=1e-4)


@pytest.mark.parametrize(("change", "kwargs", "field"), [
    ({}, {"lr": 2e-3}, "train.lr=0.002"),
    ({}, {"wd": 0.1}, "train.weight_decay=0.1"),
    ({}, {"consumed": 12}, "train.global_batch_size=6"),
    ({"lr_decay_style": "cosine", "min_lr": 1e-4}, {}, "scheduler.lr_decay_style"),
    ({"lr_decay_style": "WSD", "min_lr": 1e-4}, {}, "scheduler.lr_decay_style"),  # unknowable
    ({"lr_warmup_steps": 24}, {}, "scheduler.lr_warmup_iters"),  # step 4 is still warmup
    ({"wd_incr_style": "linear", "end_wd": 0.1}, {}, "train.weight_decay=0.0"),
])
def test_a_schedule_nutp_train_cannot_follow_is_named(change: dict[str, object],
                                                      kwargs: dict[str, object],
                                                      field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as e:
        _check({**CONSTANT, **change}, **kwargs)  # type: ignore[arg-type]
    assert "ck/iter_0000003" in str(e.value) and "\n" not in str(e.value)


def test_a_decaying_bridge_schedule_continues_in_nutp_train_s_own() -> None:
    """Bridge's cosine decay (in samples) continued by nutp-train's (in updates): the same lr at
    every remaining step, evaluated by megatron's scheduler on both sides; a different minimum
    is named."""
    from nemo_nutp.train.schedule import Schedule

    cosine = {**CONSTANT, "lr_decay_style": "cosine", "lr_warmup_steps": 12, "min_lr": 1e-4}
    ours = Schedule(lr=1e-3, min_lr=1e-4, warmup_iters=2, decay_style="cosine", decay_iters=10)
    _check(cosine, lr=ours.lr_at)
    other = Schedule(lr=1e-3, min_lr=0.0, warmup_iters=2, decay_style="cosine", decay_iters=10)
    with pytest.raises(ValueError, match=r"^train\.lr_decay_style: .* at step 3, nutp-train's"):
        _check(cosine, lr=other.lr_at)
