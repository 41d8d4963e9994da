"""The planner's memory model counts experts (issue #34): each rank of a MoE replica holds its
balanced range of routed experts (``layout/experts.py``: 8 over 3 ranks are 2/3/3), the
replicated router and its shared-expert columns, not the dense FFN; dense layers stay where
``moe_layer_freq`` says. Checked against a hand count of the tiny Qwen3-MoE test shape at
degrees 3 and 2, against the published totals of two Qwen3-MoE models, by a property (a
replica's per-rank expert elements sum to the whole), and through the planner: a layout that
fits dense but not with its experts is refused, or degraded, as a dense one would be. The
measured check (NUTP's MoE model built at ``[3,2]``, parameters counted per rank) is
``tests/model/test_moe_memory_measured.py`` (3.12 leg)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.layout import ClusterSpec, HealthReport, ModelDims, ParallelSpec, PlanRequest
from nemo_nutp.layout.memory import (
    GIB,
    MemorySpec,
    moe_layer_count,
    moe_rank_params,
    rank_param_counts,
    stage_memory,
)
from nemo_nutp.layout.plan import build_plan
from nemo_nutp.layout.specs import MoESpec

# tests/helpers/moe_reference.py's QWEN3_MOE and MoEShape (written out: this leg has no torch
# MoE): 2 layers, hidden 32, 8 heads in 4 groups of kv 8, qk-layernorm, vocab 96; 8 experts of
# width 16, top-2, every layer MoE.
TINY = ModelDims(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                 kv_channels=8, ffn_hidden_size=64, vocab_size=96, seq_length=12,
                 qk_layernorm=True)
TINY_MOE = MoESpec(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16)


def _hand(groups: int, experts: int, vocab_rows: int) -> int:
    """One rank of TINY, counted by hand: per layer a query group is QKV (2 + 2) x 8 rows x 32
    + proj 32 x (2 x 8) = 1024 + 512; an expert is fc1 (2 x 16) x 32 + fc2 32 x 16 = 1536; the
    router 8 x 32 = 256; norms 32 + 32 + 8 + 8 = 80. Two vocab tables of vocab_rows x 32, the
    final norm 32."""
    layer = groups * 1536 + experts * 1536 + 256 + 80
    return 2 * layer + 2 * vocab_rows * 32 + 32


def test_hand_counted_ranks_of_the_tiny_moe_at_degrees_3_and_2() -> None:
    # degree 3: query groups 1/1/2, experts 2/3/3, vocab 32/32/32
    want3 = [_hand(1, 2, 32), _hand(1, 3, 32), _hand(2, 3, 32)]
    assert want3 == [11968, 15040, 18112]
    assert list(rank_param_counts(TINY, 3, stage=0, pp=1, moe=TINY_MOE)) == want3
    # degree 2: query groups 2/2, experts 4/4, vocab 48/48
    assert list(rank_param_counts(TINY, 2, stage=0, pp=1, moe=TINY_MOE)) == [_hand(2, 4, 48)] * 2
    # the dense count would have held a third of the FFN (64 columns x 3 x 32 / 3 per layer),
    # far less than the most loaded rank's 3 whole experts: counting experts changes the answer
    dense = rank_param_counts(TINY, 3, stage=0, pp=1)
    assert dense.max() < rank_param_counts(TINY, 3, stage=0, pp=1, moe=TINY_MOE).max()


def test_published_qwen3_moe_totals() -> None:
    # Hugging Face Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: bf16 safetensors total_size / 2
    # (61,064,245,248 and 470,187,269,120 bytes); untied embeddings, qk-norm, 128 experts
    a3b = ModelDims(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                    kv_channels=128, ffn_hidden_size=6144, vocab_size=151936, seq_length=4096,
                    qk_layernorm=True)
    assert rank_param_counts(a3b, 1, stage=0, pp=1, moe=MoESpec(128, 8, 768))[0] == \
        30_532_122_624
    a22b = dataclasses.replace(a3b, num_layers=94, hidden_size=4096, num_attention_heads=64,
                               ffn_hidden_size=12288)
    assert rank_param_counts(a22b, 1, stage=0, pp=1, moe=MoESpec(128, 8, 1536))[0] == \
        235_093_634_560


def test_moe_layer_freq_and_shared_experts() -> None:
    dims = dataclasses.replace(TINY, num_layers=4)
    first_dense = MoESpec(8, 2, 16, moe_layer_freq=(0, 1, 1, 1))
    assert [moe_layer_count(dims, first_dense, stage=s, pp=2) for s in (0, 1)] == [1, 2]
    every_other = MoESpec(8, 2, 16, moe_layer_freq=2)  # megatron: layer i is MoE if i % 2 == 0
    assert [moe_layer_count(dims, every_other, stage=s, pp=2) for s in (0, 1)] == [1, 1]
    plain = rank_param_counts(dims, 3, stage=0, pp=2, moe=first_dense)
    dense_ffn = rank_param_counts(dims, 3, stage=0, pp=2)
    moe_all = rank_param_counts(dims, 3, stage=0, pp=2, moe=TINY_MOE)
    # stage 0 of 2 holds layers 0 (dense) and 1 (MoE): the average of the all-dense and the
    # all-MoE stage 0 (the same embedding table and norms)
    assert list(2 * plain) == list(dense_ffn + moe_all)
    # a shared expert of the dense FFN's size: over its units (64 columns: 21/21/22); one of
    # its own size (10): whole on every rank of the replica (model/moe.py)
    shared = dataclasses.replace(TINY_MOE, moe_shared_expert_intermediate_size=64)
    extra = moe_rank_params(TINY, shared, 3) - moe_rank_params(TINY, TINY_MOE, 3)
    assert list(extra) == [21 * 3 * 32, 21 * 3 * 32, 22 * 3 * 32]
    shared = dataclasses.replace(TINY_MOE, moe_shared_expert_intermediate_size=10)
    extra = moe_rank_params(TINY, shared, 3) - moe_rank_params(TINY, TINY_MOE, 3)
    assert list(extra) == [10 * 3 * 32] * 3
    with pytest.raises(ValueError, match=r"model.moe_layer_freq=\[0, 1\]: has 2 entries"):
        PlanRequest(cluster=ClusterSpec(num_gpus=8), model=dims,
                    moe=MoESpec(8, 2, 16, moe_layer_freq=(0, 1)))
    with pytest.raises(ValueError, match=r"model.moe_router_topk=9: must be in \[1, "):
        MoESpec(8, 9, 16)


@settings(max_examples=60, deadline=None)
@given(experts=st.integers(1, 64), degree=st.integers(1, 8), f=st.integers(1, 48),
       h=st.integers(1, 16), gated=st.booleans(), shared=st.one_of(st.none(),
                                                                   st.integers(8, 40)))
def test_expert_elements_over_a_replica_sum_to_the_whole(experts: int, degree: int, f: int,
                                                         h: int, gated: bool,
                                                         shared: int | None) -> None:
    t = min(degree, experts)
    dims = dataclasses.replace(TINY, hidden_size=h, num_attention_heads=1, num_query_groups=1,
                               kv_channels=1, gated_linear_unit=gated)
    moe = MoESpec(experts, 1, f, moe_shared_expert_intermediate_size=shared)
    per = moe_rank_params(dims, moe, t)
    one = ((2 if gated else 1) + 1) * f * h
    whole_shared = ((2 if gated else 1) + 1) * shared * h if shared else 0
    # router and a shared expert of its own size (not the dense FFN's 64): whole on each rank
    assert int(per.sum()) == experts * one + t * (experts * h + whole_shared)
    routed = per - experts * h - whole_shared
    assert int(routed.max() - routed.min()) <= one  # balanced: at most one expert apart
    assert int(routed.max()) == -(-experts // t) * one  # the most loaded rank: ceil(E / t)


# A Mixtral-like model the size of one 8-GPU slice: 8 layers, hidden 4096, 64 experts of
# width 1408; its dense twin's FFN is 11008 wide.
MID = ModelDims(num_layers=8, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                ffn_hidden_size=11008, vocab_size=32000, seq_length=4096)
MID_MOE = MoESpec(num_moe_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408)


def _req(gib: float, moe: MoESpec | None, failed: tuple[int, ...] = ()) -> PlanRequest:
    return PlanRequest(cluster=ClusterSpec(num_gpus=16, domain_size=8), model=MID,
                       parallel=ParallelSpec(tp_base=8), health=HealthReport(failed),
                       global_batch=16, moe=moe,
                       memory=MemorySpec(gpu_memory_gib=gib, replicas=2, reserve_gib=1.0))


def _total(t: int, moe: MoESpec | None) -> float:
    return stage_memory(MID, t, _req(80, moe).memory, stage=0, pp=1,  # type: ignore[arg-type]
                        moe=moe).total / GIB


def test_a_layout_that_fits_dense_but_not_with_experts_is_refused() -> None:
    dense8, moe8 = _total(8, None), _total(8, MID_MOE)
    assert (round(dense8, 1), round(moe8, 1)) == (6.0, 22.7)
    build_plan(_req(10.0, None))  # the dense model fits at TP8
    with pytest.raises(ValueError, match=r"parallel.tp_base=8: stage 0 at degree 8 needs 22.7 "
                                         r"GiB per GPU .* > hardware.gpu_memory_gib=10.0"):
        build_plan(_req(10.0, MID_MOE))
    with pytest.raises(ValueError, match=r"nutp.replicas=\[\[8\], \[3\]\]: replica 1: stage 0 "
                                         r"at degree 3 needs"):
        build_plan(dataclasses.replace(_req(30.0, MID_MOE), replicas=(8, 3)))
    build_plan(dataclasses.replace(_req(30.0, None), replicas=(8, 3)))  # dense: it fits


def test_a_degraded_replica_is_dropped_when_its_experts_do_not_fit() -> None:
    # 5 healthy GPUs in the first slice: dense runs it at degree 5; with experts counted a
    # degree-5 rank holds 13 of the 64 experts (35.8 GiB) and does not fit 30 GiB, nor does
    # any degree below 7, so the replica goes
    assert _total(5, None) < 30.0 < _total(5, MID_MOE) and _total(7, MID_MOE) < 30.0
    dense = build_plan(_req(30.0, None, failed=(0, 1, 2)))
    assert sorted(r.tp[0] for r in dense.replicas) == [5, 8]
    moe = build_plan(_req(30.0, MID_MOE, failed=(0, 1, 2)))
    assert [r.tp[0] for r in moe.replicas] == [8] and moe.dropped_replicas == 1


def test_the_degree_cannot_exceed_the_experts() -> None:
    few = MoESpec(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=1408)
    with pytest.raises(ValueError, match=r"model.num_moe_experts=4: fewer experts than the TP "
                                         r"degree 8"):
        build_plan(_req(80.0, few))


# the compute term (layout/cost.py): what a MoE rank computes and sends


def test_moe_compute_and_alltoall_terms_by_hand() -> None:
    from nemo_nutp.layout.cost import alltoall_bytes, stage_flops

    tokens = 24
    # TINY at degree 3, per token: a query group's attention is QKV 4 x 8 x 32 + scores and
    # values 2 x 2 x 12 x 8 + proj 2 x 8 x 32 = 1920 MACs; a routed token through one expert
    # 3 x 16 x 32 = 1536, a rank with n experts sees top-2 x n / 8 of the tokens; the router
    # 8 x 32 over the 3 sequence shards; the last rank (2 groups, 3 experts) is the slowest,
    # plus its 32 vocab rows x 32
    slowest = 2 * (2 * 1920 + 2 * 3 / 8 * 1536 + 8 * 32 / 3) + 32 * 32
    got = stage_flops(TINY, 3, 2, with_vocab=True, tokens=tokens, moe=TINY_MOE, moe_layers=2)
    assert got == pytest.approx(3 * 2 * slowest * tokens, rel=1e-12)
    assert stage_flops(TINY, 3, 2, with_vocab=True, tokens=tokens) != pytest.approx(got)
    # all-to-all: 2 layers x 4 (dispatch/combine, fwd/bwd) x 3/4 leaving x 24/4 tokens x top-2
    # x 32 x 2 bytes
    assert alltoall_bytes(TINY, TINY_MOE, 4, 2, tokens=tokens) == 2 * 4 * 0.75 * 6 * 2 * 32 * 2
    assert alltoall_bytes(TINY, TINY_MOE, 1, 2, tokens=tokens) == 0.0


def test_the_planner_times_a_degraded_moe_replica_by_its_experts() -> None:
    from nemo_nutp.layout.cost import stage_flops

    def degraded(moe: MoESpec | None) -> float:
        req = dataclasses.replace(_req(80.0, moe, failed=(0,)), memory=None)
        reps = build_plan(req).replicas
        assert sorted(r.tp[0] for r in reps) == [7, 8]
        return next(r.stage_times[0] for r in reps if r.tp[0] == 7)

    tokens = MID.seq_length
    want = {m: stage_flops(MID, 7, 8, with_vocab=True, tokens=tokens, moe=m,
                           moe_layers=8 if m else 0)
            / stage_flops(MID, 8, 8, with_vocab=True, tokens=tokens, moe=m,
                          moe_layers=8 if m else 0) for m in (None, MID_MOE)}
    assert degraded(MID_MOE) == pytest.approx(want[MID_MOE], rel=1e-12)
    assert degraded(None) == pytest.approx(want[None], rel=1e-12)
    # 10 of 64 experts on the slowest degree-7 rank against 8 at degree 8: slower than the
    # dense FFN's 8/7
    assert degraded(MID_MOE) > degraded(None)
