"""Local <-> Transformer-Engine checkpoint interchange at the level of sharded-state-dict keys
(TE is not installable here): every local layer parameter's checkpoint key, through this
project's own sharding code and megatron's local-spec keys map, is the key of the same
parameter under its TE name (TE spec: no keys map); extra state, which only one side may have
(TE's ``core_attention._extra_state``), is never requested on load."""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from nemo_nutp.checkpoint.sharding import megatron_key
from nemo_nutp.model.te_names import TE_FUSED_NORMS, local_name, read_back_on_load, te_name

LOCAL_LAYER_PARAMS = [
    "input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias"]


def test_local_and_te_parameter_keys_coincide() -> None:
    kmap = dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map)
    assert kmap == TE_FUSED_NORMS  # megatron's own statement of TE's fused names
    for layer in (0, 3):
        for p in LOCAL_LAYER_PARAMS:
            local = f"decoder.layers.{layer}.{p}"
            te = te_name(local)
            assert local_name(te) == local
            assert megatron_key(local, kmap) == megatron_key(te, {}), (local, te)
            assert ("layer_norm_" in te) == ("layernorm" in p)
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
                 "output_layer.weight"):
        assert te_name(name) == name == local_name(name)


def test_extra_state_is_not_requested_on_load() -> None:
    te_only = "decoder.layers.1.self_attention.core_attention._extra_state"
    both = "decoder.layers.1.mlp.linear_fc1._extra_state"
    assert not read_back_on_load(te_only) and not read_back_on_load(both)
    assert read_back_on_load(te_name("decoder.layers.1.input_layernorm.weight"))
