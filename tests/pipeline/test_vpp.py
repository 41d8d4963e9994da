"""Virtual pipeline stages (megatron's interleaved 1F1B, ``parallel.virtual_pipeline_model_
parallel_size``) with stages at different TP degrees.

* the ring's stage links (``pipeline.boundary.stage_links``): with virtual stages the last stage
  feeds the first stage's next chunk, so every stage — the first included — receives each of
  its activation rows exactly once from the stage before it in the ring, and every sender gets
  its gradient rows back exactly once (property-tested over degrees, sequence lengths and
  sequence parallelism);
* megatron's interleaving rule on each replica's share of micro-batches, checked at plan time
  with one line naming the fields; shares apportioned in groups of ``parallel.pp``;
* parity against stock single-process megatron-core (the harness of
  ``test_pipeline_parity.py``: losses, grad norms, step-0 gradients, final parameters within
  1e-5) for PP2 x 2 chunks (tied, unequal degrees and shares; sequence parallelism with a
  degree-2 -> degree-1 wrap-around), PP4 x 2 chunks on a degraded replica and PP2 x 3 chunks,
  with forward-only interleaved evaluation; bf16 within the parity suite's bf16 tolerance;
  two negative controls fail far outside the tolerance: the wrap-around link removed, and
  chunks holding contiguous layer blocks instead of megatron's interleaved ``c * pp + s``;
* NUTP's distributed optimizer over chunked ranks (with and without live redundancy);
* checkpoints (bench tier, ``make bench``): a chunked run's checkpoint resumes in a plain
  pipeline and in a chunked one at other degrees, and back.
"""

from __future__ import annotations

import os
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.layout import chunk_layers, interleave_error
from nemo_nutp.pipeline.boundary import rows, stage_links
from tests.helpers.dist import spawn
from tests.helpers.parity import CLIP, GQA_SWIGLU, TOL, Case, check_cases, make_plan, run_cases
from tests.helpers.roundtrip import AFTER, SAVE_AT, Job, worker


# ------------------------------------------------------------------ the ring's stage links
def _links(tp: tuple[int, ...], seq: int, sp: bool, ring: bool
           ) -> list[list[dict[str, list[tuple[int, int, int]]]]]:
    return [[stage_links(tp, s, j, seq, sp, ring=ring) for j in range(tp[s])]
            for s in range(len(tp))]


@settings(max_examples=150, deadline=None)
@given(tp=st.lists(st.integers(1, 4), min_size=2, max_size=4), mult=st.integers(1, 3),
       sp=st.booleans())
def test_ring_links_cover_every_row_once(tp: list[int], mult: int, sp: bool) -> None:
    tp_ = tuple(tp)
    pp, seq = len(tp_), 12 * mult  # divisible by every degree 1..4
    links = _links(tp_, seq, sp, ring=True)
    for s in range(pp):
        prev, nxt = (s - 1) % pp, (s + 1) % pp
        for j in range(tp_[s]):
            mine = rows(tp_[s], j, seq, sp)
            for recv, send, peer in (("recv_prev", "send_next", prev),
                                     ("recv_next", "send_prev", nxt)):
                got = sorted((lo, hi) for _, lo, hi in links[s][j][recv])
                assert got and got[0][0] == mine[0] and got[-1][1] == mine[1], (s, j, recv)
                assert all(a[1] == b[0] for a, b in pairwise(got)), got  # no gap, no overlap
                for k, lo, hi in links[s][j][recv]:  # the peer sends exactly these rows
                    assert (j, lo, hi) in links[peer][k][send], (s, j, recv, k)
                    plo, phi = rows(tp_[peer], k, seq, sp)
                    assert plo <= lo < hi <= phi  # ... and holds them
    # Each sender's pieces are received (no message without a receiver).
    for s in range(pp):
        for j in range(tp_[s]):
            for send, recv, peer in (("send_next", "recv_prev", (s + 1) % pp),
                                     ("send_prev", "recv_next", (s - 1) % pp)):
                for k, lo, hi in links[s][j][send]:
                    assert (j, lo, hi) in links[peer][k][recv]


def test_ring_adds_only_the_wrap_around_links() -> None:
    tp, seq = (2, 1, 2), 12
    plain, ring = _links(tp, seq, True, ring=False), _links(tp, seq, True, ring=True)
    assert all(not d["recv_prev"] and not d["send_prev"] for d in plain[0])
    assert all(not d["send_next"] and not d["recv_next"] for d in plain[-1])
    # the last stage (degree 2) feeds stage 0 (degree 2) row for row under SP
    assert [d["recv_prev"] for d in ring[0]] == [[(0, 0, 6)], [(1, 6, 12)]]
    for s in (1,):  # inner boundaries are unchanged
        assert ring[s] == plain[s]


def test_chunks_hold_megatrons_interleaved_blocks() -> None:
    assert chunk_layers(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert chunk_layers(6, 2, 3) == [[(0, 1), (2, 3), (4, 5)], [(1, 2), (3, 4), (5, 6)]]
    assert chunk_layers(4, 2) == [[(0, 2)], [(2, 4)]]
    with pytest.raises(ValueError, match=r"^parallel.virtual_pipeline_model_parallel_size=2: "
                       r"parallel.pp=2 times it must divide model.num_layers=6$"):
        chunk_layers(6, 2, 2)


def test_memory_model_counts_the_interleaved_passes_in_flight() -> None:
    """Stage 0 keeps ``1 + (pp - 1) / (pp vp)`` times the activations of plain 1F1B (Megatron-
    LM's interleaved-schedule memory penalty); the last stage ``(vp - 1) pp + 1`` chunk passes
    of ``L / (pp vp)`` layers (megatron's warm-up there); with ``M == pp`` every pass is in
    flight."""
    import dataclasses

    from nemo_nutp.layout import ModelDims
    from nemo_nutp.layout.memory import stage_activation_bytes
    from nemo_nutp.layout.specs import MemorySpec

    dims = ModelDims(num_layers=16)
    plain = MemorySpec(gpu_memory_gib=80.0)
    for pp, vp in ((2, 2), (4, 2), (4, 4), (2, 8)):
        spec = dataclasses.replace(plain, vp=vp)
        base = stage_activation_bytes(dims, 2, plain, stage=0, pp=pp)
        got = stage_activation_bytes(dims, 2, spec, stage=0, pp=pp)
        assert got == pytest.approx(base * (1 + (pp - 1) / (pp * vp)), rel=1e-12), (pp, vp)
        last = [stage_activation_bytes(dims, 2, s, stage=pp - 1, pp=pp) for s in (plain, spec)]
        layer = base / dims.num_layers  # stage 0 of plain 1F1B keeps pp x L/pp layers
        assert last[1] - last[0] == pytest.approx(
            layer * (((vp - 1) * pp + 1) * dims.num_layers / (pp * vp)
                     - dims.num_layers / pp)), (pp, vp)
        every = stage_activation_bytes(dims, 2, spec, stage=0, pp=pp, microbatches=pp)
        assert every == pytest.approx(layer * vp * pp * dims.num_layers / (pp * vp))


def test_cost_model_counts_every_chunks_boundary_crossing() -> None:
    """Virtual stages: every chunk crosses its stage's boundaries (the ring's wrap-around
    included), except into the first chunk of stage 0 and out of the last chunk of the last
    stage; the planner's stage times see the ring's neighbours."""
    from nemo_nutp.layout import ModelDims
    from nemo_nutp.layout.cost import CostSpec, boundary_bytes, crossings, stage_time

    assert [crossings(s, 2) for s in range(2)] == [(0, 1), (1, 0)]
    assert [crossings(s, 2, 2) for s in range(2)] == [(1, 2), (2, 1)]
    assert [crossings(s, 4, 3) for s in range(4)] == [(2, 3), (3, 3), (3, 3), (3, 2)]
    dims = ModelDims(num_layers=8)
    one = boundary_bytes(dims, 2, t_prev=1, t_next=2, tokens=64)
    assert boundary_bytes(dims, 2, t_prev=1, t_next=2, tokens=64, n_prev=3, n_next=3) == 3 * one
    spec = CostSpec.from_hardware(peak_tflops=989, nvlink_gbps=450, network_gbps=50, name="h100")
    # stage 0 of PP2 x 2 chunks: one receive (the wrap) and two sends per micro-batch; the same
    # neighbours without chunks cross once each way: one send more
    same = stage_time(dims, spec, t=2, stage=0, pp=2, tokens=64, t_prev=1, t_next=1)
    ring = stage_time(dims, spec, t=2, stage=0, pp=2, tokens=64, t_prev=1, t_next=1, vp=2)
    assert ring.compute == same.compute and ring.tp == same.tp
    send = boundary_bytes(dims, 2, t_prev=None, t_next=1, tokens=64, act_bytes=spec.act_bytes)
    assert ring.boundary - same.boundary == pytest.approx(
        send / (spec.p2p_gbps * 1e9) + 2 * spec.latency_s, rel=1e-9)


# ------------------------------------------------------------------ megatron's interleaving rule
def test_interleaving_rule_is_megatrons() -> None:
    # default group = pp: a multiple of pp, at least pp
    assert interleave_error(4, 2) is None and interleave_error(6, 3) is None
    assert "at least parallel.pp=2" in (interleave_error(1, 2) or "")
    assert "multiple of parallel.pp=2" in (interleave_error(5, 2) or "")
    # megatron's microbatch_group_size_per_vp_stage: the last group may be >= pp
    assert interleave_error(7, 2, group=4) is None  # 7 % 4 = 3 >= 2
    assert interleave_error(5, 2, group=4) is not None  # 5 % 4 = 1 < 2


def _plan(replicas: tuple[tuple[int, ...], ...], global_batch: int, **model: int) -> object:
    return make_plan(Case("x", replicas, pp=2, vp=2, global_batch=global_batch,
                          model={"num_layers": 4, **model}))


def test_every_replicas_share_is_checked_at_plan_time() -> None:
    # 7 micro-batches cannot be split into multiples of 2: one line naming the fields
    with pytest.raises(ValueError) as e:
        _plan(((2, 1), (2, 2)), 7)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("parallel.virtual_pipeline_model_parallel_size=2: "
                                              "replica 0's share is 5 of the 7 micro-batches")
    assert "train.global_batch_size / train.micro_batch_size" in msg and \
        "parallel.pp=2" in msg
    with pytest.raises(ValueError, match=r"replica 0's share is 1 .* at least parallel.pp=2"):
        _plan(((1, 1), (2, 1)), 2)
    # shares are apportioned in groups of pp: 8 -> [6, 2] (without virtual stages: [5, 3])
    plan = _plan(((2, 1), (2, 2)), 8)
    assert [r.microbatches for r in plan.replicas] == [6, 2]  # type: ignore[attr-defined]
    plain = make_plan(Case("x", ((2, 1), (2, 2)), pp=2, global_batch=8,
                           model=dict(num_layers=4)))
    assert [r.microbatches for r in plain.replicas] == [5, 3]
    with pytest.raises(ValueError, match=r"^parallel.virtual_pipeline_model_parallel_size=2: "
                       r"parallel.pp=2 times it must divide model.num_layers=6$"):
        _plan(((1, 1),), 4, num_layers=6)


def test_config_errors_name_the_field() -> None:
    from nemo_nutp.config import load_config
    from nemo_nutp.layout import ParallelSpec

    with pytest.raises(ValueError, match=r"^parallel.virtual_pipeline_model_parallel_size=2: "
                       r"needs parallel.pp > 1 \(parallel.pp=1\)$"):
        ParallelSpec(tp_base=2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"^parallel.virtual_pipeline_model_parallel_size=0"):
        ParallelSpec(tp_base=2, pp=2, virtual_pipeline_model_parallel_size=0)
    base = ["parallel.pp=2", "parallel.virtual_pipeline_model_parallel_size=2"]
    with pytest.raises(ValueError, match=r"^parallel.virtual_pipeline_model_parallel_size=2: "
                       r"parallel.pp=2 times it must divide model.num_layers=6"):
        load_config([*base, "model.num_layers=6"])
    with pytest.raises(ValueError, match=r"^nutp.rebalance=True: not with parallel.virtual_"):
        load_config([*base, "model.num_layers=4", "nutp.rebalance=true"])
    with pytest.raises(ValueError, match=r"^recovery.mode='live': not with parallel.virtual_"):
        load_config([*base, "model.num_layers=4", "recovery.enabled=true",
                     "recovery.mode=live", "checkpoint.interval=2"])
    cfg = load_config([*base, "model.num_layers=4"])
    assert cfg.parallel.vp == 2


# ------------------------------------------------------------------ parity with stock megatron
CASES = [
    # tied embeddings, first/last stage at different degrees, unequal shares [6, 2]
    Case("pp2_vp2_tied", ((2, 1), (2, 2)), pp=2, vp=2, clip_grad=CLIP, global_batch=8, steps=3,
         eval_interval=1, model=dict(num_layers=4, tie_embeddings=True, add_bias_linear=True)),
    # sequence parallelism: the wrap-around sends sequence pieces (replica 1: degree 2 -> 1)
    Case("pp2_vp2_sp", ((2, 2), (1, 2)), pp=2, vp=2, clip_grad=CLIP, sequence_parallel=True,
         steps=3, global_batch=6, model=dict(GQA_SWIGLU, num_layers=4)),
    Case("pp4_vp2_degraded", ((2, 2, 1, 2),), pp=4, vp=2, clip_grad=CLIP, steps=2,
         global_batch=8, model=dict(num_layers=8, tie_embeddings=True)),
    Case("pp2_vp3", ((2, 1), (2, 2)), pp=2, vp=3, clip_grad=CLIP, steps=2, global_batch=6,
         model=dict(num_layers=6)),
    Case("pp2_vp2_bf16", ((2, 1), (2, 2)), pp=2, vp=2, clip_grad=CLIP, precision="bf16",
         steps=3, global_batch=8, model=dict(GQA_SWIGLU, num_layers=4)),
    Case("control_vp_no_wrap", ((2, 2), (1, 2)), pp=2, vp=2, clip_grad=CLIP,
         sequence_parallel=True, steps=2, global_batch=6, model=dict(GQA_SWIGLU, num_layers=4),
         control="vp_no_wrap"),
    Case("control_vp_contiguous_blocks", ((2, 1), (2, 2)), pp=2, vp=2, clip_grad=CLIP,
         global_batch=8, steps=2, model=dict(num_layers=4, tie_embeddings=True,
                                             add_bias_linear=True),
         control="vp_contiguous_blocks"),
]


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_vpp_parity(tmp_path: Path) -> None:
    res = run_cases(CASES, 7, tmp_path)
    assert res["pp2_vp2_tied"]["shares"] == [6, 2]
    ev = res["pp2_vp2_tied"]
    assert len(ev["val_rel"]) == 3 and max(ev["val_rel"]) <= TOL, ev["val_rel"]
    check_cases(res, CASES)
    for name in ("control_vp_no_wrap", "control_vp_contiguous_blocks"):
        bad = res[name]
        # (layer order barely moves the tiny model's first losses; its gradients do)
        assert max(bad["loss_rel"]) > TOL, (name, bad["loss_rel"])
        assert max(bad["norm_rel"]) > 100 * TOL, (name, bad["norm_rel"])
        assert bad["grad_rel_max"] > 100 * TOL, (name, bad["grad_rel_max"])
        assert bad["model_rel"] > 100 * TOL, (name, bad["model_rel"])


# ------------------------------------------------------------------ checkpoints across layouts
FOUR = {"extra": {"model": dict(num_layers=4, add_bias_linear=True, tie_embeddings=True),
                  "clip_grad": 0.05}}
CKPT_STEPS = [
    (1, [Job("tp1", (1,), reference=True, **FOUR)]),
    # PP2 x 2 chunks saves (and reloads itself); PP2 without chunks loads it and saves
    (7, [Job("vp2", ((2, 1), (2, 2)), pp=2, vp=2, save=True, **FOUR)]),
    (6, [Job("pp2", ((1, 2), (2, 1)), pp=2, load=("vp2",), save=True, **FOUR)]),
    # ... which PP2 x 2 chunks at other degrees loads (with vp2's own)
    (5, [Job("vp2_b", ((1, 1), (2, 1)), pp=2, vp=2, load=("pp2", "vp2"), **FOUR)]),
]


@pytest.mark.dist
@pytest.mark.bench
@pytest.mark.skipif(os.environ.get("NUTP_BENCH") != "1",
                    reason="bench tier (about 60 s on 2 cores): make bench, or NUTP_BENCH=1")
@pytest.mark.timeout(900)
def test_checkpoints_with_virtual_stages(tmp_path: Path) -> None:
    """A PP2 x 2-chunk run saves megatron's global layer axis (every chunk's layers at their
    global index): a PP2 run without chunks and a PP2 x 2-chunk run at other degrees resume
    from it (optimizer state included), and the chunked run from the plain one; losses equal
    an uninterrupted single-process TP1 run within 1e-5."""
    import json

    for world, jobs in CKPT_STEPS:
        spawn(worker, world, (jobs,), tmp_path)
    results: dict[str, dict[str, object]] = {}
    for f in tmp_path.glob("*.json"):
        results.setdefault(f.stem.split("@")[0], {}).update(json.loads(f.read_text()))
    ref = results["tp1"]["reference"]
    assert isinstance(ref, list)
    checked = []
    for dst, res in results.items():
        for key, losses in res.items():
            if key.startswith("from_") or key in ("self", "fresh"):
                assert isinstance(losses, list)
                want = ref[:SAVE_AT] if key == "fresh" else ref[SAVE_AT:SAVE_AT + AFTER]
                rel = [abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)]
                print(f"{key:>10} -> {dst:<6} loss_rel={max(rel):.1e}")
                assert max(rel) <= TOL, (key, dst, losses, want)
                checked.append((key, dst))
    assert sorted(checked) == sorted([
        ("fresh", "vp2"), ("self", "vp2"), ("from_vp2", "pp2"), ("fresh", "pp2"),
        ("self", "pp2"), ("from_pp2", "vp2_b"), ("from_vp2", "vp2_b")]), checked


# ------------------------------------------------------------------ the distributed optimizer
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_distributed_optimizer_with_virtual_stages(tmp_path: Path) -> None:
    """NUTP's ZeRO-1 over a chunked rank (every chunk's parameters in the one sync engine's
    buckets), with and without ``recovery.live_redundancy``: the parity suite's checks, state
    kept once across the world (``tests/sync/test_zero.py``'s)."""
    import json

    from tests.helpers.parity import check_parity, run_references
    from tests.helpers.zero_jobs import parity_worker

    tied = dict(num_layers=4, tie_embeddings=True, add_bias_linear=True)
    cases = [Case("zero_vp2_tied", ((2, 1), (2, 2)), pp=2, vp=2, clip_grad=CLIP,
                  global_batch=8, steps=3, model=tied),
             Case("zero_vp2_tied_redundant", ((2, 1), (2, 2)), pp=2, vp=2, clip_grad=CLIP,
                  global_batch=8, steps=3, model=tied, zero_redundancy=True)]
    run_references(cases, tmp_path)
    spawn(parity_worker, 7, (cases,), tmp_path)
    for c in cases:
        r = json.loads((tmp_path / f"{c.name}.json").read_text())
        print(f"{c.name}: loss_rel={max(r['loss_rel']):.2e} norm_rel={max(r['norm_rel']):.2e} "
              f"model_rel={r['model_rel']:.2e} state={r['state']}")
        assert r["grads_compared"]  # pipeline + tied: all-reduced buckets, gradients compared
        check_parity(r, clip=c.clip_grad)
        # state kept about once across the world (Adam moments; redundancy: twice, fp32
        # masters too), every copy equal to its primary
        per_elem, copies = (12, 2) if r["redundancy"] else (8, 1)
        for b, n in r["state"]:
            assert 0 < b <= copies * (1 / r["replicas"] + 0.05) * n * per_elem, r["state"]
        assert r["backup_diff"] == 0.0, r["backup_diff"]
