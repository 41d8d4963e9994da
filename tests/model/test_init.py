"""Globally consistent per-unit-block initialisation (``nemo_nutp.model.init``), no processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.layout import PARAM_KINDS, ModelDims, global_index, local_layout
from nemo_nutp.layout.units import (
    global_shape,
    kinds_of,
    local_shape,
    max_degree,
    num_units,
    space_bounds,
)
from nemo_nutp.model.init import (
    constant_value,
    init_global,
    init_param_,
    init_std,
    piece_key,
    unit_view,
)
from tests.helpers.strategies import any_model_dims

# A random-initialised name: the layout tests use it for every kind (biases included), so the
# assembly check is never trivially true for a constant.
RANDOM = "decoder.layers.0.mlp.linear_fc1.weight"
PIECES = st.sampled_from([1, 2, 5, 16, 64, 1 << 20])


def _units(dims: ModelDims, kind: str) -> int:
    return num_units(dims, PARAM_KINDS[kind].space)


def _shard(kind: str, dims: ModelDims, lo: int, hi: int, *, seed: int = 7, name: str = RANDOM,
           piece_elems: int = 1 << 20, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    local = torch.full(local_shape(kind, dims, hi - lo), float("nan"), dtype=dtype)
    init_param_(local, name=name, kind=kind, units=(lo, hi), dims=dims, seed=seed, std=0.02,
                piece_elems=piece_elems)
    return local


@settings(max_examples=100, deadline=None)
@given(dims=any_model_dims(), data=st.data())
def test_unit_view_is_a_canonical_strided_view(dims: ModelDims, data: st.DataObject) -> None:
    for kind in kinds_of(dims):
        u = _units(dims, kind)
        lo = data.draw(st.integers(0, u - 1), label=f"{kind} lo")
        hi = data.draw(st.integers(lo + 1, u), label=f"{kind} hi")
        units = np.arange(lo, hi)
        local = torch.from_numpy(local_layout(kind, dims, units)).view(
            local_shape(kind, dims, hi - lo))
        view = unit_view(kind, dims, local)
        assert view.data_ptr() == local.data_ptr() and view.shape[0] == hi - lo
        assert view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        canon = torch.from_numpy(global_index(kind, dims, units))
        assert torch.equal(view.reshape(hi - lo, -1), canon), kind


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("n_local", [1, 2, 3, 5])
def test_unit_view_every_kind(gated: bool, n_local: int, mla: bool) -> None:
    extra = dict(kv_lora_rank=5, q_lora_rank=3, qk_head_dim=2, qk_pos_emb_head_dim=1,
                 v_head_dim=2) if mla else {}
    dims = ModelDims(hidden_size=6, num_attention_heads=6, num_query_groups=6, kv_channels=2,
                     ffn_hidden_size=7, vocab_size=9, gated_linear_unit=gated,
                     add_bias_linear=not mla, **extra)
    for kind in kinds_of(dims):
        units = np.arange(1, 1 + n_local)
        local = torch.from_numpy(local_layout(kind, dims, units)).view(
            local_shape(kind, dims, n_local))
        got = unit_view(kind, dims, local)
        for i in range(n_local):
            assert torch.equal(got[i].reshape(-1), torch.from_numpy(
                global_index(kind, dims, units)[i])), (kind, i)


@settings(max_examples=150, deadline=None)
@given(dims=any_model_dims(), data=st.data(), piece=PIECES, seed=st.integers(0, 2**40))
def test_shards_assemble_into_the_global_tensor(dims: ModelDims, data: st.DataObject,
                                                piece: int, seed: int) -> None:
    balance = data.draw(st.sampled_from(["work", "units"]), label="balance")
    t = data.draw(st.integers(1, max_degree(dims)), label="degree")
    for kind in kinds_of(dims):
        pk = PARAM_KINDS[kind]
        full = init_global(RANDOM, kind, dims, seed, 0.02, piece_elems=piece).reshape(-1)
        assert not torch.isnan(full).any()
        b = space_bounds(dims, pk.space, t, balance)
        for lo, hi in zip(b[:-1].tolist(), b[1:].tolist()):
            local = _shard(kind, dims, lo, hi, seed=seed, piece_elems=piece)
            idx = torch.from_numpy(local_layout(kind, dims, np.arange(lo, hi)))
            assert torch.equal(full[idx], local.reshape(-1)), (kind, t, lo, hi)


@settings(max_examples=60, deadline=None)
@given(dims=any_model_dims(), data=st.data(), piece=PIECES)
def test_any_unit_range_matches_and_low_precision_casts(dims: ModelDims, data: st.DataObject,
                                                       piece: int) -> None:
    kind = data.draw(st.sampled_from(sorted(kinds_of(dims))), label="kind")
    u = _units(dims, kind)
    lo = data.draw(st.integers(0, u - 1), label="lo")
    hi = data.draw(st.integers(lo + 1, u), label="hi")
    full = init_global(RANDOM, kind, dims, 3, 0.02, piece_elems=piece).reshape(-1)
    idx = torch.from_numpy(local_layout(kind, dims, np.arange(lo, hi)))
    for dtype in (torch.float32, torch.bfloat16):
        local = _shard(kind, dims, lo, hi, seed=3, piece_elems=piece, dtype=dtype)
        assert torch.equal(full[idx].to(dtype), local.reshape(-1)), dtype


def test_pieces_are_the_canonical_sequence() -> None:
    """Pins the definition: unit-major canonical elements = concatenated per-piece draws."""
    dims = ModelDims(hidden_size=4, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=10, gated_linear_unit=True)
    full = init_global(RANDOM, "fc1_weight", dims, 11, 0.5, piece_elems=24)  # 3 units a piece
    canon = full.reshape(-1)[torch.from_numpy(global_index("fc1_weight", dims, np.arange(10)))]
    draws = []
    for k, count in enumerate([24, 24, 24, 8]):
        gen = torch.Generator().manual_seed(piece_key(11, RANDOM, f"b{k}"))
        draws.append(torch.randn(count, generator=gen) * 0.5)
    assert torch.equal(canon.reshape(-1), torch.cat(draws))


def test_large_units_split_into_row_pieces() -> None:
    dims = ModelDims(hidden_size=8, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=6, kv_channels=3)
    # proj unit view (H=8, per_unit=6): 48 elements > 20; pieces of 3 rows (18 elements).
    full = init_global(RANDOM, "proj_weight", dims, 5, 1.0, piece_elems=20)
    view = unit_view("proj_weight", dims, full)
    gen = torch.Generator().manual_seed(piece_key(5, RANDOM, "u1.r2"))
    assert torch.equal(view[1, 6:8], torch.randn(12, generator=gen).view(2, 6))


def test_megatron_stds() -> None:
    dims = ModelDims(num_layers=8, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=512, vocab_size=300)
    std = 0.02
    cases = {
        "module.module.decoder.layers.3.self_attention.linear_qkv.weight": ("qkv_weight", std),
        "decoder.layers.3.mlp.linear_fc1.weight": ("fc1_weight", std),
        "embedding.word_embeddings.weight": ("word_embedding", std),
        "output_layer.weight": ("output_layer", std),
        "decoder.layers.3.self_attention.linear_proj.weight": ("proj_weight", std / 4.0),
        "module.decoder.layers.3.mlp.linear_fc2.weight": ("fc2_weight", std / 4.0),
    }
    for name, (kind, want) in cases.items():
        assert init_std(name, dims, std) == pytest.approx(want)
        w = init_global(name, kind, dims, 1, std)
        assert abs(w.std().item() / want - 1) < 0.1, name
        assert abs(w.mean().item()) < want / 10, name
    pos = init_global("embedding.position_embeddings.weight", None, dims, 1, std,
                      shape=(128, 64))
    assert abs(pos.std().item() / std - 1) < 0.1
    assert init_std("decoder.layers.0.mlp.linear_fc2.weight", ModelDims(num_layers=2),
                    1.0) == pytest.approx(0.5)


def test_norms_one_biases_zero() -> None:
    dims = ModelDims(add_bias_linear=True)
    ones = ["decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight",
            "module.decoder.layers.1.pre_mlp_layernorm.weight",
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    zeros = ["decoder.layers.0.input_layernorm.bias", "decoder.layers.0.mlp.linear_fc2.bias",
             "decoder.layers.0.self_attention.linear_proj.bias",
             "decoder.layers.0.mlp.linear_fc1.layer_norm_bias"]
    for name in ones + zeros:
        assert init_std(name, dims, 0.02) is None
        p = torch.full((dims.hidden_size,), float("nan"))
        init_param_(p, name=name, kind=None, units=None, dims=dims, seed=0, std=0.02)
        assert torch.equal(p, torch.full_like(p, 1.0 if name in ones else 0.0)), name
        assert constant_value(name) == (1.0 if name in ones else 0.0)
    for name, kind in (("decoder.layers.0.self_attention.linear_qkv.bias", "qkv_bias"),
                       ("decoder.layers.0.mlp.linear_fc1.bias", "fc1_bias")):
        assert torch.equal(init_global(name, kind, dims, 0, 0.02),
                           torch.zeros(global_shape(kind, dims)))
    with pytest.raises(ValueError, match="not a constant"):
        constant_value("output_layer.weight")
    # zero-centred gamma (Gemma): every norm weight from 0, as megatron's and TE's norms and
    # HF's Gemma2RMSNorm initialise it (the norm scales by 1 + weight)
    from nemo_nutp.config import ModelConfig

    gemma = ModelConfig(layernorm_zero_centered_gamma=True, post_layernorm=True)
    for name in [*ones, "decoder.layers.0.self_attention.linear_proj.post_layernorm.weight",
                 "decoder.layers.0.self_attention.q_layernorm.weight",
                 "decoder.final_layernorm.weight"]:
        p = torch.full((gemma.hidden_size,), float("nan"))
        init_param_(p, name=name, kind=None, units=None, dims=gemma, seed=0, std=0.02)
        assert torch.equal(p, torch.zeros_like(p)), name
    with pytest.raises(ValueError, match="no init rule"):
        init_std("decoder.layers.0.something", dims, 0.02)


def test_seeds_and_names_differ_prefixes_do_not() -> None:
    dims = ModelDims()
    a = init_global(RANDOM, "fc1_weight", dims, 1, 0.02)
    assert not torch.equal(a, init_global(RANDOM, "fc1_weight", dims, 2, 0.02))
    other = RANDOM.replace("layers.0", "layers.1")
    assert not torch.equal(a, init_global(other, "fc1_weight", dims, 1, 0.02))
    assert torch.equal(a, init_global("module.module." + RANDOM, "fc1_weight", dims, 1, 0.02))
    assert len({piece_key(1, RANDOM, f"b{k}") for k in range(1000)}) == 1000


def test_rejects_wrong_shapes_and_units() -> None:
    dims = ModelDims()
    with pytest.raises(ValueError, match="shape"):
        init_param_(torch.empty(3, 64), name=RANDOM, kind="fc1_weight", units=(0, 2),
                    dims=dims, seed=0, std=0.02)
    with pytest.raises(ValueError, match="outside"):
        init_param_(torch.empty(local_shape("fc1_weight", dims, 2)), name=RANDOM,
                    kind="fc1_weight", units=(127, 129), dims=dims, seed=0, std=0.02)
    with pytest.raises(ValueError, match="needs units"):
        init_param_(torch.empty(2, 64), name=RANDOM, kind="fc1_weight", units=None,
                    dims=dims, seed=0, std=0.02)
    with pytest.raises(ValueError, match="replicated"):
        init_param_(torch.empty(12, 64), name="embedding.position_embeddings.weight",
                    kind=None, units=(0, 5), dims=dims, seed=0, std=0.02)
