"""Reshard plans proven on arrays of global indices.

Each replica's ranks hold their local tensors (in megatron's memory order) filled with *global
flat indices*. Applying the reshard plan must put, at every shard owner, the shard's units in the
sync-buffer order — identical in every replica — and the reverse plan must restore every local
tensor exactly. Gated fc1 (two halves), GQA QKV (per-group rows) and dim-1 splits are covered.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.layout import (
    PARAM_KINDS,
    ModelDims,
    assignment,
    global_index,
    local_layout,
    make_sync_layout,
    moved_lower_bound,
    num_units,
    reshard_plan,
)
from nemo_nutp.layout.units import local_unit_positions, unit_numel
from tests.helpers.strategies import model_dims


def _apply(kind: str, dims: ModelDims, degree: int, mode: str, degrees: list[int]
           ) -> tuple[dict[int, np.ndarray], int]:
    """Returns {shard: buffer at its owner} and the moved element count."""
    n = num_units(dims, PARAM_KINDS[kind].space)
    lay = make_sync_layout(n, degrees, mode)
    b = assignment(n, degree)
    e = unit_numel(kind, dims)
    local = {j: local_layout(kind, dims, np.arange(b[j], b[j + 1])) for j in range(degree)}
    pos = {j: local_unit_positions(kind, dims, int(b[j + 1] - b[j])) for j in range(degree)}
    plan = reshard_plan(lay, degree)
    own = lay.owners[degree]
    buffers = {k: np.full((lay.shards[k + 1] - lay.shards[k]) * e, -1, dtype=np.int64)
               for k in range(lay.num_shards)}

    def shard_of(u: int) -> int:
        return int(np.searchsorted(lay.shards, u, side="right")) - 1

    def put(k: int, lo: int, hi: int, payload: np.ndarray) -> None:
        off = (lo - lay.shards[k]) * e
        assert np.all(buffers[k][off:off + (hi - lo) * e] == -1), "unit filled twice"
        buffers[k][off:off + (hi - lo) * e] = payload

    moved = 0
    for src, dst, lo, hi in plan.transfers:
        k = shard_of(lo)
        assert own[k] == dst and shard_of(hi - 1) == k
        put(k, lo, hi, local[src][pos[src][lo - b[src]:hi - b[src]]].reshape(-1))
        moved += (hi - lo) * e
    for k in range(lay.num_shards):  # units already on their owner are copied locally
        j = int(own[k])
        lo, hi = max(lay.shards[k], b[j]), min(lay.shards[k + 1], b[j + 1])
        if hi > lo:
            put(k, lo, hi, local[j][pos[j][lo - b[j]:hi - b[j]]].reshape(-1))
    # Reverse plan: owners send back; every local tensor is rebuilt from the buffers alone.
    rebuilt = {j: np.full_like(local[j], -1) for j in range(degree)}
    for k in range(lay.num_shards):
        j = int(own[k])
        lo, hi = max(lay.shards[k], b[j]), min(lay.shards[k + 1], b[j + 1])
        if hi > lo:
            off = (lo - lay.shards[k]) * e
            rebuilt[j][pos[j][lo - b[j]:hi - b[j]].reshape(-1)] = buffers[k][
                off:off + (hi - lo) * e]
    for _src, dst, lo, hi in plan.reverse().transfers:
        k = shard_of(lo)
        off = (lo - lay.shards[k]) * e
        rebuilt[dst][pos[dst][lo - b[dst]:hi - b[dst]].reshape(-1)] = buffers[k][
            off:off + (hi - lo) * e]
    for j in range(degree):
        assert np.array_equal(rebuilt[j], local[j]), (kind, degree, j)
    return buffers, moved


@settings(max_examples=120, deadline=None)
@given(dims=model_dims(min_units=2), data=st.data(), mode=st.sampled_from(["refine", "base"]))
def test_reshard_gives_identical_sync_buffers(dims: ModelDims, data: st.DataObject,
                                              mode: str) -> None:
    for kind in ("qkv_weight", "qkv_bias", "proj_weight", "fc1_weight", "fc1_bias",
                 "fc2_weight", "word_embedding"):
        n = num_units(dims, PARAM_KINDS[kind].space)
        degrees = data.draw(st.lists(st.integers(1, min(n, 9)), min_size=1, max_size=4),
                            label=kind)
        lay = make_sync_layout(n, degrees, mode)
        for t in set(degrees):
            buffers, moved = _apply(kind, dims, t, mode, degrees)
            for k, buf in buffers.items():
                want = global_index(kind, dims, np.arange(lay.shards[k], lay.shards[k + 1]))
                assert np.array_equal(buf, want.reshape(-1)), (kind, t, k)
            lower = moved_lower_bound(n, t, lay.shards) * unit_numel(kind, dims)
            assert moved == lower
            if mode == "refine":
                assert moved == 0


@given(n=st.integers(1, 400), data=st.data())
def test_base_layout_brute_force_lower_bound(n: int, data: st.DataObject) -> None:
    degs = data.draw(st.lists(st.integers(1, min(n, 12)), min_size=1, max_size=3))
    lay = make_sync_layout(n, degs, "base")
    for t in set(degs):
        b = assignment(n, t)
        holder = np.searchsorted(b, np.arange(n), side="right") - 1
        best = 0
        for k in range(lay.num_shards):  # brute force: best owner per shard
            h = holder[lay.shards[k]:lay.shards[k + 1]]
            best += len(h) - np.bincount(h).max()
        assert reshard_plan(lay, t).moved_units == best


def test_uniform_layout_moves_nothing_and_matches_dp_groups() -> None:
    lay = make_sync_layout(12, [4, 4, 4], "base")
    assert reshard_plan(lay, 4).transfers == ()
    assert list(lay.owners[4]) == [0, 1, 2, 3]


@settings(max_examples=150, deadline=None)
@given(units=st.integers(1, 300), degrees=st.lists(st.integers(1, 8), min_size=2, max_size=4),
       mode=st.sampled_from(["refine", "base"]), data=st.data())
def test_nic_aware_owners(units: int, degrees: list[int], mode: str, data: st.DataObject
                          ) -> None:
    """Issue #36 item 3(a): a replica with slow NICs re-chooses its own owners. Every unit is
    still owned once per replica; a rank slower than the fastest owns nothing (a peer at the
    full rate exists); the other replicas' owners of every unit are unchanged (``refine``) or
    move no more units than before (``base``: re-chosen by overlap); the full-rate
    ranks' unit counts differ by at most one unit beyond what the balance needs; the reshard
    moves stay consistent (each moved piece lands at its shard's owner)."""
    degrees = [min(d, units) for d in degrees]
    i = data.draw(st.integers(0, len(degrees) - 1))
    t = degrees[i]
    slow = data.draw(st.dictionaries(st.integers(0, t - 1), st.sampled_from([0.25, 0.5]),
                                     max_size=max(t - 1, 0)))
    from nemo_nutp.layout.sync import nic_aware

    base = make_sync_layout(units, degrees, mode)
    lay = nic_aware(base, i, t, slow)
    if t < 2 or not slow:
        assert lay is base
        return

    def unit_owner(layout: object, rep: int, deg: int) -> np.ndarray:
        own = layout.owners_of(deg, rep)  # type: ignore[attr-defined]
        return np.repeat(own, np.diff(layout.shards))  # type: ignore[attr-defined]

    for r, d in enumerate(degrees):  # refine: unchanged; base: re-chosen by overlap, never
        if r != i:  # moving more than before
            if mode == "refine":
                assert np.array_equal(unit_owner(lay, r, d), unit_owner(base, r, d))
            assert (reshard_plan(lay, d, r).moved_units
                    <= reshard_plan(base, d, r).moved_units)
    mine = unit_owner(lay, i, t)
    assert len(mine) == units
    counts = np.bincount(mine, minlength=t)
    assert all(counts[j] == 0 for j in slow)
    fast = [j for j in range(t) if j not in slow]
    assert max(counts[fast]) - min(counts[fast]) <= 1, counts
    for src, dst, lo, hi in reshard_plan(lay, t, i).transfers:
        assert np.all(mine[lo:hi] == dst) and src != dst


def test_nic_aware_plan_predicts_the_mitigated_sync() -> None:
    """Two TP4 replicas in two domains, GPU 5's NIC at 1/4: unmitigated, the sync takes 4x
    (GPU 5 and its partner GPU 1 carry a quarter of the units at 1/4 of the rate); with the
    NIC-aware owners GPU 5 owns nothing and its three peers carry 4/3 of a healthy rank's
    bytes at the full rate (~1.33x). A plan without slow links is the healthy one, bit for
    bit."""
    from nemo_nutp.config import load_config
    from nemo_nutp.config.derived import plan_request
    from nemo_nutp.layout import build_plan

    base = ["health.failed_gpus=[]", "parallel.tp_base=4"]
    healthy = build_plan(plan_request(load_config(base)))
    aware = build_plan(plan_request(load_config([*base, "health.slow_links={5: 0.25}"])))
    assert healthy.rank_to_gpu == aware.rank_to_gpu
    rate, slow = 1.0, {5: 0.25}
    t0 = healthy.sync_seconds(rate)
    assert healthy.sync_seconds(rate, slow) / t0 >= 3.9
    ratio = aware.sync_seconds(rate, slow) / t0
    assert 1.3 <= ratio <= 1.45, ratio
    five = [g for g, _ in aware.sync_traffic() if 5 in g]
    assert not five  # GPU 5 reduces nothing across replicas
    assert sum(b for _, b in aware.sync_traffic()) == sum(b for _, b in healthy.sync_traffic())


@settings(max_examples=200, deadline=None)
@given(load=st.lists(st.floats(0, 1e10), min_size=1, max_size=8),
       unit=st.sampled_from([0.0, 1.0, 128.0, 6144.0, 3e6]), units=st.integers(0, 200_000),
       data=st.data())
def test_waterfill_counts_are_a_partition(load: list[float], unit: float, units: int,
                                          data: st.DataObject) -> None:
    """``_waterfill`` gives every rank >= 0 units summing to ``units`` (a space without bytes
    per unit -- the vocab space of a middle pipeline stage -- included), and no unit could
    finish sooner elsewhere by more than one unit's time."""
    from nemo_nutp.layout.sync import _waterfill

    rate = np.array(data.draw(st.lists(st.sampled_from([0.25, 0.5, 1.0]), min_size=len(load),
                                       max_size=len(load))))
    ld = np.array(load)
    n = _waterfill(ld, rate, unit, units)
    assert n.min() >= 0 and int(n.sum()) == units, n
    if unit > 0 and units:
        finish = (ld + n * unit) / rate
        start_more = (ld + (n + 1) * unit) / rate
        busy = n > 0
        assert finish[busy].max() <= start_more.min() * (1 + 1e-9) + 1e-6, (n, finish)
