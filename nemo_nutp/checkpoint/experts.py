"""The optimizer state of an NUTP MoE model in stock megatron-core's one-optimizer format.

NUTP tags every expert parameter ``allreduce=False`` (``model/moe.py``: megatron's DDP keeps
them in its expert buffers, ``sync/experts.py`` syncs them), so megatron's
``get_megatron_optimizer`` builds a ``ChainedOptimizer`` of two: the dense parameters' and the
experts' (groups ``is_expert_parallel=True``). Its own ``sharded_state_dict`` then writes
``chained_0.optimizer.state.*`` / ``chained_1.optimizer.state.*`` and two lists of groups, which
stock megatron-core at expert parallelism 1 (one optimizer, experts in the dense groups:
``tests/helpers/moe_reference.py``) neither writes nor reads.

Here both optimizers' state goes into one megatron optimizer state dict, as stock EP1 writes
it: every parameter's Adam state under ``optimizer.state.<name>.<megatron key>`` (the experts'
under megatron's global expert keys, ``checkpoint/sharding.py``), the dense optimizer's groups
as the groups (the experts' groups equal the dense groups but for ``is_expert_parallel``), one
``common_step``. Loading splits it again: the expert optimizer's groups take the hyperparameters
of the loaded group with the same identifier but ``is_expert_parallel``. Any other optimizer
(dense models, the distributed optimizer) passes through unchanged.
"""

from __future__ import annotations

import copy
from typing import Any


def dense_and_experts(optimizer: Any) -> tuple[Any, Any] | None:
    """(dense optimizer, expert optimizer) of a chained optimizer of exactly those two (None
    otherwise)."""
    inner = list(getattr(optimizer, "chained_optimizers", []))
    if len(inner) != 2 or getattr(optimizer, "nutp_zero", False):
        return None
    expert = [all(g.get("is_expert_parallel", False) for g in o.param_groups) for o in inner]
    if sorted(expert) != [False, True]:
        return None
    return (inner[0], inner[1]) if expert == [False, True] else (inner[1], inner[0])


def _count(optimizer: Any) -> int:
    return sum(len(g["params"]) for g in optimizer.param_groups)


def optimizer_sharded_state_dict(optimizer: Any, model_sd: dict[str, Any], *,
                                 is_loading: bool = False) -> Any:
    """``optimizer.sharded_state_dict(model_sd)``, a dense + expert pair as one optimizer."""
    pair = dense_and_experts(optimizer)
    if pair is None:
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    dense, expert = pair
    optimizer._synchronize_steps()  # megatron's own: one step for both
    d = dense.sharded_state_dict(model_sd, is_loading)
    e = expert.sharded_state_dict(model_sd, is_loading)
    n = _count(dense)
    state = dict(d["state"])
    state.update({n + k: v for k, v in e["state"].items() if k != "common_step"})
    if "common_step" not in state and "common_step" in e["state"]:
        state["common_step"] = e["state"]["common_step"]
    return {"state": state, "param_groups": d["param_groups"]}


def _identifier(group: dict[str, Any], *, expert: bool | None = None) -> tuple[Any, ...]:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    out = []
    for key in param_group_identifier_keys:
        value = group.get(key, group.get(f"pre_{key}"))
        out.append(expert if key == "is_expert_parallel" and expert is not None else value)
    return tuple(out)


def load_optimizer_state(optimizer: Any, loaded: Any) -> None:
    """``optimizer.load_state_dict(loaded)`` of a state dict written by
    ``optimizer_sharded_state_dict`` (or by stock megatron-core's one optimizer)."""
    pair = dense_and_experts(optimizer)
    if pair is None:
        optimizer.load_state_dict(loaded)
        return
    dense, expert = pair
    n = _count(dense)
    state = loaded["state"]
    ids = [k for k in state if isinstance(k, int)]
    dense_state: dict[Any, Any] = {k: state[k] for k in ids if k < n}
    expert_state: dict[Any, Any] = {k - n: state[k] for k in ids if k >= n}
    if "common_step" in state:
        dense_state["common_step"] = state["common_step"]
        expert_state["common_step"] = copy.deepcopy(state["common_step"])
    groups = loaded["param_groups"]
    by_id = {_identifier(g, expert=True): g for g in groups}
    mine = expert.state_dict()["param_groups"]  # the expert optimizer's own parameter ids
    expert_groups = []
    for group in mine:
        saved = by_id.get(_identifier(group, expert=True))
        if saved is None:
            raise ValueError(f"optimizer: no saved parameter group for the experts' group "
                             f"{_identifier(group)} (saved: {[_identifier(g) for g in groups]})")
        g = {k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
        g["is_expert_parallel"] = True
        g["params"] = list(group["params"])
        expert_groups.append(g)
    dense.load_state_dict({"state": dense_state, "param_groups": groups})
    expert.load_state_dict({"state": expert_state, "param_groups": expert_groups})
    optimizer._synchronize_steps()
