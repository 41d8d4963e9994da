"""Unit assignments and element index maps (pure numpy)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.layout import PARAM_KINDS, ModelDims, assignment, global_index, local_layout
from nemo_nutp.layout.units import (
    global_shape,
    kinds_of,
    local_shape,
    local_unit_positions,
    max_degree,
    num_units,
    rank_work,
    space_bounds,
    unit_numel,
    unit_view_shape,
)
from tests.helpers.strategies import any_model_dims, model_dims


@given(n=st.integers(1, 5000), data=st.data())
def test_assignment_balanced_and_complete(n: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, min(n, 300)))
    b = assignment(n, t)
    counts = np.diff(b)
    assert b[0] == 0 and b[-1] == n and len(b) == t + 1
    assert counts.min() >= 1 and counts.max() - counts.min() <= 1


@settings(max_examples=150, deadline=None)
@given(dims=any_model_dims(), data=st.data())
def test_local_layouts_partition_the_global_tensor(dims: ModelDims, data: st.DataObject) -> None:
    for kind in kinds_of(dims):
        pk = PARAM_KINDS[kind]
        n = {"qg": dims.num_query_groups, "ffn": dims.ffn_hidden_size,
             "vocab": dims.vocab_size}[pk.space]
        t = data.draw(st.integers(1, n), label=kind)
        b = assignment(n, t)
        numel = int(np.prod(global_shape(kind, dims)))
        seen = np.concatenate([local_layout(kind, dims, np.arange(b[j], b[j + 1]))
                               for j in range(t)])
        assert np.array_equal(np.sort(seen), np.arange(numel)), kind
        for j in range(t):
            units = np.arange(b[j], b[j + 1])
            lay = local_layout(kind, dims, units)
            assert lay.size == int(np.prod(local_shape(kind, dims, len(units))))
            pos = local_unit_positions(kind, dims, len(units))
            canon = global_index(kind, dims, units)
            assert canon.shape == (len(units), unit_numel(kind, dims))
            assert np.array_equal(lay[pos], canon), kind
            assert np.all(np.diff(canon, axis=1) > 0)  # canonical = ascending global index


@settings(max_examples=150, deadline=None)
@given(dims=any_model_dims(), data=st.data())
def test_unit_views_give_canonical_order(dims: ModelDims, data: st.DataObject) -> None:
    """The O(1) strided view (what the sync engine moves) selects, for any unit range of any
    rank, exactly the global elements ``global_index`` names, in its canonical order."""
    for kind in kinds_of(dims):
        pk = PARAM_KINDS[kind]
        n = num_units(dims, pk.space)
        t = data.draw(st.integers(1, n), label=kind)
        b = assignment(n, t)
        j = data.draw(st.integers(0, t - 1), label=f"{kind} rank")
        units = np.arange(b[j], b[j + 1])
        h, n_local, w = unit_view_shape(kind, dims, len(units))
        lay = local_layout(kind, dims, units)  # global index of each local element
        assert h * n_local * w == lay.size, kind
        lo = data.draw(st.integers(0, len(units) - 1), label=f"{kind} lo")
        hi = data.draw(st.integers(lo + 1, len(units)), label=f"{kind} hi")
        got = lay.reshape(h, n_local, w).transpose(1, 0, 2)[lo:hi].reshape(hi - lo, -1)
        assert np.array_equal(got, global_index(kind, dims, units[lo:hi])), kind


def test_layouts_match_megatron_memory_order() -> None:
    """Spot checks against how megatron-core stores TP shards (worked out by hand)."""
    d = ModelDims(hidden_size=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=4,
                  vocab_size=5, kv_channels=1, gated_linear_unit=True)
    g = np.arange(8 * 2).reshape(8, 2)  # gated fc1 global: gate rows 0..3, up rows 4..7
    assert np.array_equal(g.reshape(-1)[local_layout("fc1_weight", d, np.arange(2, 4))],
                          g[[2, 3, 6, 7]].reshape(-1))  # [gate_local; up_local]
    qkv = np.arange(2 * 4 * 2).reshape(8, 2)  # 2 groups x (2 q + k + v) rows
    assert np.array_equal(qkv.reshape(-1)[local_layout("qkv_weight", d, np.array([1]))],
                          qkv[4:8].reshape(-1))
    proj = np.arange(2 * 4).reshape(2, 4)  # columns: group0 heads 0,1 | group1 heads 2,3
    assert np.array_equal(proj.reshape(-1)[local_layout("proj_weight", d, np.array([1]))],
                          proj[:, 2:4].reshape(-1))
    fc2 = np.arange(2 * 4).reshape(2, 4)
    assert np.array_equal(fc2.reshape(-1)[global_index("fc2_weight", d, np.array([3]))[0]],
                          fc2[:, 3])


@settings(max_examples=200, deadline=None)
@given(dims=model_dims(min_units=2), data=st.data())
def test_work_balanced_ffn_never_slower(dims: ModelDims, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, max_degree(dims)))
    for space in ("qg", "ffn", "vocab"):
        for balance in ("work", "units"):
            b = space_bounds(dims, space, t, balance)
            counts = np.diff(b)
            assert b[0] == 0 and b[-1] == num_units(dims, space) and counts.min() >= 1
            if balance == "units" or space != "ffn":
                assert counts.max() - counts.min() <= 1
    slow_work = rank_work(dims, t, 2, with_vocab=False, balance="work").max()
    slow_units = rank_work(dims, t, 2, with_vocab=False, balance="units").max()
    assert slow_work <= slow_units * (1 + 1e-12)


def test_work_balance_example() -> None:
    """4 query groups over 3 ranks: the rank with 2 groups gets fewer FFN columns."""
    d = ModelDims(hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=96, seq_length=12)
    assert list(np.diff(space_bounds(d, "qg", 3))) == [1, 1, 2]
    ffn = np.diff(space_bounds(d, "ffn", 3))
    assert ffn.sum() == 96 and ffn[2] < ffn[0]
