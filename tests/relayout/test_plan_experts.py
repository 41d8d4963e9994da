"""Move plans with MoE experts (``relayout.plan``, ``experts=MoveExperts``), pure: property
tests over drawn clusters, failures, expert counts and MoE layer patterns.

Checked independently of the planner (with ``layout.experts.local_experts``): every expert a
new rank holds (in its stage's replica, at its new degree) comes whole from exactly one piece,
whose source is a survivor that held that expert at the same stage in the old plan (the rank's
own old rank, as a local copy, when it held it); each new rank receives exactly the experts it
did not hold: its expert bytes are the lower bound ``(experts new to it) x (MoE layers of its
stage) x expert elements x bytes per element``, and its received bytes equal the plan's lower
bound. The dense spaces keep their guarantees (``test_plan.py``'s ``_check``). Bad settings are
refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nemo_nutp.layout import (
    ClusterSpec,
    HealthReport,
    ModelDims,
    ParallelSpec,
    PlanRequest,
    build_plan,
)
from nemo_nutp.layout.cost import stage_layers
from nemo_nutp.layout.experts import local_experts
from nemo_nutp.relayout import plan_move, survivor_rank_map
from nemo_nutp.relayout.plan import EXPERT, MoveExperts, holding, move_experts, unit_elems

DIMS = ModelDims(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=8,
                 ffn_hidden_size=40, vocab_size=37, seq_length=8)
EXPERT_NUMEL = 3 * 16 * 32  # gated fc1 (2 x 16, 32) + fc2 (32, 16)


def _plans(domains: int, tb: int, pp: int, failed: list[int], extra: int) -> tuple:
    n = domains * tb
    req = PlanRequest(cluster=ClusterSpec(num_gpus=n, domain_size=tb, gpus_per_node=tb),
                      model=DIMS, parallel=ParallelSpec(tp_base=tb, pp=pp),
                      health=HealthReport(failed_gpus=tuple(sorted(set(failed)))),
                      global_batch=64)
    old = build_plan(req)
    new = build_plan(dataclasses.replace(
        req, health=HealthReport(failed_gpus=tuple(sorted(set(failed) | {extra})))))
    return old, new


def _held(plan, rank: int, num_experts: int) -> tuple[int, set[int]]:
    i, s, j = plan.rank_index[rank]
    return s, set(local_experts(num_experts, plan.replicas[i].tp[s], j))


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    tb = draw(st.sampled_from([2, 3, 4]))
    pp = draw(st.sampled_from([1, 2]))
    domains = draw(st.integers(1, 4)) * pp
    n = domains * tb
    failed = draw(st.lists(st.integers(0, n - 1), max_size=3))
    extra = draw(st.integers(0, n - 1))
    num_experts = draw(st.integers(tb, 12))
    layers = tuple(draw(st.lists(st.booleans(), min_size=4, max_size=4)))
    return domains, tb, pp, failed, extra, num_experts, layers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_expert_whole_from_one_survivor_that_held_it(case: tuple) -> None:
    domains, tb, pp, failed, extra, num_experts, layers = case
    try:
        old, new = _plans(domains, tb, pp, failed, extra)
    except ValueError:
        assume(False)
        return
    assume(old.pp == new.pp)
    rmap = survivor_rank_map(old, new)
    assume(sorted(rmap.values()) == list(range(new.world_size)))
    ex = MoveExperts(num_experts, EXPERT_NUMEL, layers)
    bpe = 12
    move = plan_move(old, new, rmap, bytes_per_elem=bpe, experts=ex)
    inv = {n: o for o, n in rmap.items()}
    if not move.possible:  # then some unit of some new rank has no surviving holder
        assert "held by no survivor" in move.reason, move.reason
        return
    by_dst: dict[int, list] = {}
    for p in move.pieces:
        if p.space == EXPERT:
            by_dst.setdefault(p.dst, []).append(p)
    for n in range(new.world_size):
        s, mine = _held(new, n, num_experts)
        first, last = stage_layers(DIMS.num_layers, pp)[s]
        n_moe = sum(layers[first:last])
        got = by_dst.pop(n, [])
        if n_moe == 0:  # a stage without MoE layers holds no expert units
            assert not got, (n, got)
            continue
        cover = sorted(e for p in got for e in range(p.lo, p.hi))
        assert cover == sorted(mine), (n, cover, mine)  # every expert exactly once
        o = inv[n]
        os_, had = _held(old, o, num_experts)
        had = had if os_ == s else set()
        for p in got:
            ss, src_had = _held(old, p.src, num_experts)
            assert p.src in rmap and ss == s and set(range(p.lo, p.hi)) <= src_had, p
            assert move.is_local(p) == (p.src == o), p
            assert p.elems == (p.hi - p.lo) * n_moe * EXPERT_NUMEL, p
            if move.is_local(p):
                assert set(range(p.lo, p.hi)) <= had, p
        expert_in = sum(p.elems for p in got if not move.is_local(p)) * bpe
        assert expert_in == len(mine - had) * n_moe * EXPERT_NUMEL * bpe, n
        assert move.received_bytes[n] == move.lower_bound_bytes[n], n
    assert not by_dst, by_dst
    assert sum(move.sent_bytes.values()) == sum(move.received_bytes.values())


def test_kill_a_tp3_rank_experts_come_whole_from_the_other_replica() -> None:
    """[3, 2] over 8 experts (2/3/3 and 4/4), a TP3 rank dies: [2, 2]. The degraded
    replica's survivors take the experts they lack from the healthy replica (their old TP peer
    that held them is dead or holds others), each exactly its lower bound; the healthy
    replica moves nothing."""
    req = PlanRequest(cluster=ClusterSpec(num_gpus=6, domain_size=3, gpus_per_node=3),
                      model=DIMS, parallel=ParallelSpec(tp_base=3),
                      replicas=(3, 2), global_batch=4)
    old = build_plan(req)
    new = build_plan(dataclasses.replace(req, replicas=(2, 2),
                                         health=HealthReport(failed_gpus=(1,))))
    rmap = survivor_rank_map(old, new)
    ex = MoveExperts(8, EXPERT_NUMEL, (True,) * 4)
    move = plan_move(old, new, rmap, experts=ex)
    assert move.possible, move.reason
    moved = [p for p in move.pieces if p.space == EXPERT and not move.is_local(p)]
    assert moved and all(old.rank_index[p.src][0] == 1 or p.src in rmap for p in moved)
    healthy = [rmap[r] for r in old.replicas[1].ranks[0]]
    assert all(move.received_bytes[n] == 0 for n in healthy)
    for n in range(new.world_size):
        assert move.received_bytes[n] == move.lower_bound_bytes[n]
    # new rank of old rank 0 held experts 0-1, now 0-3: 2 experts x 4 layers
    n0 = rmap[0]
    got = sum(p.elems for p in moved if p.dst == n0) * 12
    assert got == 2 * 4 * EXPERT_NUMEL * 12
    assert unit_elems(new, 0, EXPERT, ex) == 4 * EXPERT_NUMEL
    assert holding(new, n0, EXPERT, ex)[2:] == (0, 4)


def test_move_experts_reads_moe_settings_and_refuses_by_name() -> None:
    from types import SimpleNamespace

    def moe(**kw):
        base = dict(num_moe_experts=8, moe_ffn_hidden_size=16, mtp_num_layers=None,
                    moe_router_enable_expert_bias=False,
                    moe_shared_expert_intermediate_size=None,
                    moe_layers=lambda n: [i % 2 == 0 for i in range(n)])
        return SimpleNamespace(**{**base, **kw})

    ex = move_experts(DIMS, moe())
    assert ex == MoveExperts(8, EXPERT_NUMEL, (True, False, True, False))
    with pytest.raises(ValueError, match=r"^model\.mtp_num_layers=1: "):
        move_experts(DIMS, moe(mtp_num_layers=1))
    with pytest.raises(ValueError, match=r"^model\.moe_router_enable_expert_bias=True: "):
        move_experts(DIMS, moe(moe_router_enable_expert_bias=True))
    with pytest.raises(ValueError, match=r"^model\.kv_lora_rank=None: "):
        move_experts(DIMS, moe(multi_latent_attention=True))
    old, new = _plans(2, 4, 1, [], 3)
    with pytest.raises(ValueError, match=r"^model\.num_moe_experts=2: "):
        plan_move(old, new, survivor_rank_map(old, new),
                  experts=MoveExperts(2, EXPERT_NUMEL, (True,) * 4))
