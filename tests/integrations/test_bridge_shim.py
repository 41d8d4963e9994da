"""Megatron-Bridge 0.6.2 on CPU (Python 3.12 / megatron-core 0.19.2, ``make test-bridge``): the
scoped import shim, the recipe + YAML/CLI override path, NUTP key validation. Skipped, by name,
where Bridge is not installed (the Python 3.11 suite)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

from nemo_nutp.compat.bridge_cpu import (
    CUDA_TENSOR_FUNCS,
    NCCL_GROUP_FUNCS,
    SCOPED_STUBS,
    TORCH_PROXY_MODULES,
    install_import_shim,
)
from nemo_nutp.integrations.bridge_config import load_bridge_job

RECIPE = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
TINY = Path(__file__).parent / "data" / "bridge_tiny.yaml"


def test_shim_targets_still_import_what_is_stubbed() -> None:
    """Each module given stub names still imports the stubbed package at module level, and the
    package is still missing here: when a pinned Bridge changes either, the shim is stale."""
    install_import_shim()  # find_spec imports the parent packages
    for module, packages in SCOPED_STUBS.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{module}: gone from the pinned Bridge"
        source = Path(spec.origin).read_text()
        for package in packages:
            pattern = rf"^(import|from) {re.escape(package)}[ .]"
            assert re.search(pattern, source, re.M), (
                f"{module} no longer imports {package} at module level: drop its stub")
            assert importlib.util.find_spec(package) is None, (
                f"{package} is installed now: its stub in {module} is not needed")


def test_bridge_imports_without_a_global_transformer_engine() -> None:
    install_import_shim()
    import megatron.bridge.recipes.gpt.vanilla_gpt
    import megatron.bridge.training.pretrain
    import megatron.bridge.training.train  # noqa: F401
    from megatron.core.extensions import transformer_engine as mte

    leaked = [m for m in sys.modules
              if m.split(".")[0] in ("transformer_engine", "nvidia_resiliency_ext")]
    assert leaked == []
    assert not getattr(mte, "HAVE_TE", False)  # megatron-core still on its local code paths


def test_recipe_yaml_and_cli_overrides_apply() -> None:
    job = load_bridge_job(RECIPE, str(TINY), ["model.tensor_model_parallel_size=2",
                                             "mixed_precision=null", "optimizer.bf16=false",
                                             "train.train_iters=5",
                                             "cluster.gpus_per_node=8"])
    m = job.bridge.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (2, 64,
                                                                                      128, 4)
    assert (m.hidden_dropout, m.attention_dropout, m.tensor_model_parallel_size) == (0.0, 0.0, 2)
    assert job.bridge.train.train_iters == 5 and job.bridge.mixed_precision is None
    assert job.nutp.nutp.replicas == [2, 1] and job.nutp.parallel.tp_base == 2
    assert job.nutp.cluster.gpus_per_node == 8
    assert not hasattr(job.bridge, "nutp")


@pytest.mark.parametrize("override, key", [
    ("nutp.replicaz=[2,1]", "nutp.replicaz"),
    ("nutp.rebalance_smoothing=2.0", "nutp.rebalance_smoothing"),
    ("health.failed_gpus=oops", "health.failed_gpus"),
    ("failures.failed_gpus=oops", "health.failed_gpus"),  # the deprecated name, mapped
])
def test_bad_nutp_key_is_one_line_before_any_group(override: str, key: str,
                                                   tmp_path: Path) -> None:
    import torch.distributed as dist

    bad = tmp_path / "bad.yaml"
    name, value = override.split("=", 1)
    section, field = name.split(".", 1)
    bad.write_text(TINY.read_text().replace("nutp:\n  replicas: [2, 1]\n", "")
                   + f"{section}:\n  {field}: {value}\n")
    with pytest.raises(ValueError) as e:
        load_bridge_job(RECIPE, str(bad), [])
    msg = str(e.value)
    assert key in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match=re.escape(key)):
        load_bridge_job(RECIPE, str(TINY), [override])
    assert not dist.is_initialized()


def test_failures_is_health_for_one_release(tmp_path: Path) -> None:
    """``failures`` (``health``'s name before), as a YAML block or an argument, is NUTP's and
    maps to ``health`` with its warning, as under ``nutp-train``."""
    old = tmp_path / "old.yaml"
    old.write_text(TINY.read_text() + "failures:\n  failed_gpus: [2]\n")
    for config, args in ((old, []), (TINY, ["failures.failed_gpus=[2]"])):
        with pytest.warns(FutureWarning, match=r"failures\.failed_gpus is deprecated: use "
                                               r"health\.failed_gpus"):
            job = load_bridge_job(RECIPE, str(config), [*args, *BASE, "nutp.replicas=null"])
        assert job.nutp.health.failed_gpus == [2] and not hasattr(job.bridge, "failures")


def test_nutp_bridge_cli_bad_key_exits_2_with_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    from nemo_nutp.launch.bridge_cli import main

    assert main(["--recipe", RECIPE, "--config-file", str(TINY), "nutp.replicaz=[2,1]"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "nutp.replicaz" in err[0], err


def test_a_bridge_config_error_is_one_line_before_any_process(
        capfd: pytest.CaptureFixture[str]) -> None:
    """A sequence length the dataset and the model disagree on fails Bridge's own check in
    every rank; a recovery supervisor then blamed every GPU. The launcher says it in one line
    naming the field and starts nothing."""
    from nemo_nutp.launch.bridge_cli import main

    base = ["--recipe", RECIPE, "--config-file", str(TINY), "nutp.replicas=[1]"]
    assert main([*base, "dataset.seq_length=16", "recovery.enabled=true"]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "dataset.seq_length=16" in err[0] and "model.seq_length=32" in err[0]


def test_cpu_patch_targets_still_exist_and_call_cuda() -> None:
    """Every function the CPU redirections are for still exists in the pinned Bridge /
    megatron-core and still makes the CUDA call the patch redirects."""
    import importlib
    import inspect

    install_import_shim()
    for modname, funcs in TORCH_PROXY_MODULES:
        module = importlib.import_module(modname)
        assert isinstance(getattr(module, "torch", None), type(sys)), modname
        for qual in funcs.split():
            owner: object = module
            for part in qual.split("."):
                owner = getattr(owner, part, None)
                assert owner is not None, f"{modname}.{qual}: gone from the pinned version"
            source = inspect.getsource(owner)  # type: ignore[arg-type]
            assert re.search(r"torch\.cuda\.|device=\"cuda\"", source), (
                f"{modname}.{qual} no longer calls CUDA: drop its redirection")
    for modname, func in CUDA_TENSOR_FUNCS:
        source = inspect.getsource(getattr(importlib.import_module(modname), func))
        assert ".cuda(" in source, f"{modname}.{func} no longer calls .cuda(): drop the patch"
    for modname, func in NCCL_GROUP_FUNCS:
        source = inspect.getsource(getattr(importlib.import_module(modname), func))
        assert 'backend="nccl"' in source, (
            f"{modname}.{func} no longer asks for NCCL groups: drop the patch")


@pytest.mark.parametrize("override, message", [
    ("model.rotary_percent=0.1", "model.rotary_percent=0.1: rotates"),
    # MoE trains in fp32 (tests/integrations/test_bridge_moe.py); the recipe's bf16 is named
    ("model.num_moe_experts=4", "model.bf16=True: NUTP MoE (4 experts) trains fp32"),
    ("model.context_parallel_size=2", "model.context_parallel_size=2: not supported"),
    ("model.position_embedding_type=mrope", "model.position_embedding_type=mrope: not supported"),
    ("model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=None: required"),
])
def test_model_fields_the_nutp_model_cannot_honour_are_rejected_by_name(
        override: str, message: str) -> None:
    """``model_config_of``: a recipe setting that changes the math and that the NUTP model does
    not implement is a one-line ``ValueError`` naming it, before any process group."""
    import torch.distributed as dist

    extra = []
    if override.startswith("model.rotary_percent"):  # the recipe's positions are learned
        extra = ["model.position_embedding_type=rope"]
    with pytest.raises(ValueError) as e:
        load_bridge_job(RECIPE, str(TINY), [override, *extra])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not dist.is_initialized()


def test_rope_settings_reach_the_nutp_model() -> None:
    """The norms' epsilon, Llama 3.1's RoPE (base 500000, scaling factor 8) and partial RoPE
    with position interpolation become the NUTP model's fields (megatron's names), not
    defaults; a RoPE setting beside learned absolute positions is refused by name (it would be
    ignored)."""
    from nemo_nutp.integrations.bridge_run import model_config_of

    rope = "model.position_embedding_type=rope"  # the vanilla GPT recipe's are learned
    job = load_bridge_job(RECIPE, str(TINY), [rope, "model.rotary_base=500000",
                                              "model.rope_scaling=true",
                                              "model.rope_scaling_factor=8.0"])
    m = model_config_of(job.bridge.model, vocab_size=256)
    assert (m.rotary_base, m.rope_scaling, m.rope_scaling_factor) == (500000, True, 8.0)
    job = load_bridge_job(RECIPE, str(TINY), [rope, "model.rotary_percent=0.5",
                                              "model.seq_len_interpolation_factor=2.0",
                                              "model.layernorm_epsilon=1e-6"])
    m = model_config_of(job.bridge.model, vocab_size=256)
    assert m.layernorm_epsilon == 1e-6  # was silently megatron's 1e-5
    assert (m.rotary_percent, m.seq_len_interpolation_factor, m.rope_scaling) == (0.5, 2.0,
                                                                                  False)
    job = load_bridge_job(RECIPE, str(TINY), ["model.add_bias_linear=false",
                                              "model.add_qkv_bias=true"])
    m = model_config_of(job.bridge.model, vocab_size=256)
    assert (m.add_bias_linear, m.add_qkv_bias, m.qkv_bias) == (False, True, True)  # Qwen2's biases
    job = load_bridge_job(RECIPE, str(TINY), ["model.qk_layernorm=true"])
    assert model_config_of(job.bridge.model, vocab_size=256).qk_layernorm  # Qwen3's QK norm
    job = load_bridge_job(RECIPE, str(TINY), ["model.window_size=[16,0]",
                                              "model.window_attn_skip_freq=2"])
    m = model_config_of(job.bridge.model, vocab_size=256)  # silently dropped before
    assert (m.window_size, m.window_attn_skip_freq) == ((16, 0), 2)
    with pytest.raises(ValueError, match=r"^model.rotary_base=500000: needs model.position_"):
        load_bridge_job(RECIPE, str(TINY), ["model.rotary_base=500000"])


def test_yarn_settings_reach_the_nutp_model() -> None:
    """gpt-oss's YaRN (Bridge provider fields ``yarn_*``, as its HF bridge sets them) becomes the
    NUTP model's; a YaRN field without yarn is refused by name (megatron would ignore it)."""
    from nemo_nutp.integrations.bridge_run import model_config_of

    yarn = ["model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=32.0",
            "model.yarn_original_max_position_embeddings=4096", "model.yarn_beta_fast=32.0",
            "model.yarn_beta_slow=1.0", "model.yarn_correction_range_round_to_int=false"]
    job = load_bridge_job(RECIPE, str(TINY), yarn)
    m = model_config_of(job.bridge.model, vocab_size=256)
    assert (m.position_embedding_type, m.yarn_rotary_scaling_factor,
            m.yarn_original_max_position_embeddings, m.yarn_beta_fast, m.yarn_beta_slow,
            m.yarn_mscale, m.yarn_correction_range_round_to_int) == (
        "yarn", 32.0, 4096, 32.0, 1.0, None, False)
    with pytest.raises(ValueError, match=r"^model.yarn_beta_fast=32.0: needs model.position_"):
        load_bridge_job(RECIPE, str(TINY), ["model.yarn_beta_fast=32.0"])


GEMMA_DIMS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, kv_channels=16, seq_length=32)


def _gemma(cls_name: str, **kw: object) -> object:
    install_import_shim()
    from megatron.bridge.models.gemma import gemma2_provider, gemma3_provider, gemma_provider

    for module in (gemma_provider, gemma2_provider, gemma3_provider):
        if hasattr(module, cls_name):
            return getattr(module, cls_name)(**{**GEMMA_DIMS, **kw})
    raise AssertionError(cls_name)


def test_gemma_providers_reach_the_nutp_model() -> None:
    """Bridge's Gemma, Gemma 2 and Gemma 3 providers: what their fields, ``provide`` and layer
    specs build becomes the NUTP model's settings (zero-centred norms, embedding scaling,
    Gemma 2's query_pre_attn_scalar as the softmax scale, its softcaps and odd-layer window,
    Gemma 3's int window, layer pattern and (local, global) RoPE bases, post norms)."""
    from nemo_nutp.integrations.bridge_run import model_config_of

    def fields(m: object, *names: str) -> tuple[object, ...]:
        return tuple(getattr(m, n) for n in names)

    m = model_config_of(_gemma("GemmaModelProvider"), vocab_size=256)
    assert fields(m, "layernorm_zero_centered_gamma", "apply_embedding_scaling",
                  "embedding_scale_rounded", "post_layernorm") == (True, True, True, False)
    m = model_config_of(_gemma("Gemma2ModelProvider"), vocab_size=256)
    assert fields(m, "softmax_scale", "attn_logit_softcapping", "final_logit_softcapping",
                  "window_size", "window_attn_skip_freq", "post_layernorm",
                  "layernorm_zero_centered_gamma") == (
        1.0 / 224 ** 0.5, 50.0, 30.0, (4095, 0), 2, True, True)
    m = model_config_of(_gemma("Gemma3ModelProvider", rope_scaling_factor=8.0), vocab_size=256)
    assert fields(m, "rotary_base", "rotary_base_local", "rope_scaling_factor_global",
                  "window_size", "window_attn_skip_freq", "softmax_scale", "qk_layernorm",
                  "embedding_scale_rounded", "post_layernorm", "attn_logit_softcapping") == (
        1000000, 10000, 8.0, (511, 0), 6, 1 / 16, True, False, True, None)


@pytest.mark.parametrize("cls_name, kw, message", [
    ("Gemma2ModelProvider", dict(window_attn_skip_freq=3),
     r"^model.window_attn_skip_freq=3: not read by gemma2's attention"),
    ("Gemma2ModelProvider", dict(softmax_scale=0.5),
     r"^model.softmax_scale=0.5: Gemma 2's attention uses model.query_pre_attn_scalar=224"),
    ("Gemma3ModelProvider", dict(rope_scaling=True), r"^model.rope_scaling=True: Gemma 3"),
    ("Gemma3ModelProvider", dict(is_vision_language=True),
     r"^model.is_vision_language=True: not supported"),
    ("Gemma3ModelProvider", dict(rotary_percent=0.5), r"^model.rotary_percent=0.5: Gemma 3"),
    ("Gemma3ModelProvider", dict(window_size=(7, 0)), r"^model.window_size=\(7, 0\): not "),
    ("Gemma2ModelProvider", dict(add_bias_linear=True),
     r"^model.post_layernorm=True: needs model.add_bias_linear=false"),
])
def test_gemma_settings_that_do_not_map_are_refused_by_name(cls_name: str, kw: dict[str, object],
                                                            message: str) -> None:
    from nemo_nutp.integrations.bridge_run import model_config_of

    with pytest.raises(ValueError, match=message):
        model_config_of(_gemma(cls_name, **kw), vocab_size=256)


def test_per_layer_rope_bases_outside_gemma3_are_refused_by_name() -> None:
    from nemo_nutp.integrations.bridge_run import model_config_of

    job = load_bridge_job(RECIPE, str(TINY), ["model.position_embedding_type=rope"])
    job.bridge.model.rotary_base = (10000, 1000000)
    with pytest.raises(ValueError, match=r"^model.rotary_base=\(10000, 1000000\): per-layer"):
        model_config_of(job.bridge.model, vocab_size=256)


def test_optimizer_precision_other_than_the_models_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"^optimizer.bf16=True: the model is fp32"):
        load_bridge_job(RECIPE, str(TINY), ["mixed_precision=null"])


def test_activations_reach_the_nutp_model_and_others_are_rejected_by_name() -> None:
    """megatron's activations (Nemotron's squared ReLU, Gemma's fast GeLU, ...) by name; a
    function the NUTP model does not build is one line naming it."""
    import torch
    from megatron.core.activations import fast_gelu, squared_relu

    from nemo_nutp.integrations.bridge_run import model_config_of

    job = load_bridge_job(RECIPE, str(TINY), [])  # the recipe's bf16 (model and optimizer)
    for func, name in ((squared_relu, "squared_relu"), (fast_gelu, "fast_gelu")):
        job.bridge.model.activation_func = func
        assert model_config_of(job.bridge.model, vocab_size=256).activation_func == name
    job.bridge.model.activation_func = torch.tanh
    with pytest.raises(ValueError, match=r"^model.activation_func=tanh: not supported by the "):
        model_config_of(job.bridge.model, vocab_size=256)


def test_embedding_scaling_rounds_as_each_gemma_provider_does() -> None:
    """The NUTP model's embedding scaling in bf16 (where rounding the factor matters: sqrt(96)
    is 9.8125 in bf16): rounded as Bridge's ``EmbeddingScalingMixin`` (Gemma, Gemma 2), or
    unrounded as Bridge's ``Gemma3LanguageModelEmbedding`` (``embeddings * hidden ** 0.5``)."""
    import types

    import torch

    install_import_shim()
    from megatron.bridge.models.gemma.modules import EmbeddingScalingMixin, extend_instance

    from nemo_nutp.model.layers import _scale_embeddings

    out = (torch.randn(4, 2, 96) * 0.02).bfloat16()

    class Raw(torch.nn.Module):
        def forward(self, **_: object) -> torch.Tensor:
            return out

    for rounded in (True, False):
        cfg = types.SimpleNamespace(hidden_size=96, embedding_scale_rounded=rounded)
        raw = Raw()
        raw.config = cfg  # type: ignore[assignment]
        if rounded:
            extend_instance(raw, EmbeddingScalingMixin)
            want = raw()
        else:
            want = out * (cfg.hidden_size ** 0.5)  # Gemma3LanguageModelEmbedding.forward
        got = _scale_embeddings(types.SimpleNamespace(config=cfg), (), out)
        assert torch.equal(got, want), rounded
    cfg.embedding_scale_rounded = True
    assert not torch.equal(_scale_embeddings(types.SimpleNamespace(config=cfg), (), out), want)
    import inspect

    from megatron.bridge.models.gemma.gemma3_provider import Gemma3LanguageModelEmbedding

    source = inspect.getsource(Gemma3LanguageModelEmbedding.forward).replace(" ", "")
    assert "embeddings*(self.config.hidden_size**0.5)" in source  # the pinned Bridge's formula


def test_mixed_precision_by_name_is_resolved_by_bridge() -> None:
    """``mixed_precision="bf16_mixed"`` (the recipe's own) is resolved by Bridge's
    ``get_mixed_precision_config`` and applied to the model and optimizer before the plan (NUTP
    trains bf16); an unknown name is one line naming the field."""
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

    job = load_bridge_job(RECIPE, str(TINY), [])
    assert isinstance(job.bridge.mixed_precision, MixedPrecisionConfig)
    assert job.bridge.model.bf16 and job.bridge.optimizer.bf16
    assert job.nutp.train.precision == "bf16"
    with pytest.raises(ValueError, match=r"^mixed_precision=bf16_nonsense: Unknown mixed-"):
        load_bridge_job(RECIPE, str(TINY), ["mixed_precision=bf16_nonsense"])


BASE = ["model.tensor_model_parallel_size=2", "mixed_precision=null", "optimizer.bf16=false"]


def test_nutp_sections_are_not_bridge_keys_and_bridge_keys_reach_the_schema(
        tmp_path: Path) -> None:
    """``output`` and ``recovery`` are NUTP sections (as ``nutp``, ``health``, ``cluster``: no
    top-level key of Bridge's ``ConfigContainer``); the schema sections that are Bridge's
    (``model``, ``train``, ``checkpoint``) are mapped onto the NUTP job: ``checkpoint.save`` ->
    ``checkpoint.dir``, ``save_interval`` -> ``interval`` (0 without ``save``; Bridge's null,
    one save at the end, -> ``train.train_iters``), ``load`` -> ``load_dir``, the distributed
    optimizer -> ``train.distributed_optimizer``."""
    import dataclasses

    install_import_shim()
    from megatron.bridge.training.config import ConfigContainer

    from nemo_nutp.integrations.bridge_config import NUTP_SECTIONS

    bridge = {f.name for f in dataclasses.fields(ConfigContainer)}
    assert {"output", "recovery"} <= set(NUTP_SECTIONS) and not bridge & set(NUTP_SECTIONS)
    assert {"model", "train", "checkpoint"} <= bridge
    save, load = tmp_path / "it's saved", tmp_path / "loaded"
    job = load_bridge_job(RECIPE, str(TINY), [
        *BASE, f"checkpoint.save=\"{save}\"", "checkpoint.save_interval=2",
        f"checkpoint.load={load}", "optimizer.use_distributed_optimizer=true"])
    c = job.nutp.checkpoint
    assert (c.dir, c.interval, c.load_dir) == (str(save), 2, str(load))
    assert job.nutp.train.distributed_optimizer
    job = load_bridge_job(RECIPE, str(TINY), [*BASE, f"checkpoint.save=\"{save}\"",
                                              "checkpoint.save_interval=null"])
    assert job.nutp.checkpoint.interval == 3 and not job.nutp.train.distributed_optimizer
    job = load_bridge_job(RECIPE, str(TINY), [*BASE, "checkpoint.save=null"])
    assert (job.nutp.checkpoint.dir, job.nutp.checkpoint.interval) == (None, 0)


def test_output_dir_is_one_setting(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``output.dir`` (default ``runs/bridge``) and the CLI's ``--output-dir`` are one setting:
    either sets it; both, different, is one error line naming both."""
    from nemo_nutp.launch.bridge_cli import main

    assert load_bridge_job(RECIPE, str(TINY), BASE).nutp.output.dir == "runs/bridge"
    out = str(tmp_path / "a b")
    assert load_bridge_job(RECIPE, str(TINY), [*BASE, f"output.dir='{out}'"]).nutp.output.dir \
        == out
    assert load_bridge_job(RECIPE, str(TINY), BASE, output_dir=out).nutp.output.dir == out
    assert main(["--recipe", RECIPE, "--config-file", str(TINY), "--output-dir", out,
                 "output.dir=elsewhere", *BASE]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"--output-dir={out}" in err[0] and \
        "output.dir=elsewhere" in err[0], err


@pytest.mark.parametrize("override, says", [
    ("recovery.mode=sometimes", "recovery.mode='sometimes': must be restart or live"),  # schema
    # the schema's own rule (the recipe's optimizer.use_distributed_optimizer is off)
    ("recovery.live_redundancy=true", "recovery.live_redundancy=True: needs "
                                      "train.distributed_optimizer"),
])
def test_recovery_keys_are_nutp_keys(override: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        load_bridge_job(RECIPE, str(TINY), [*BASE, override])
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_tokenizer_vocabulary_is_bridges_padded_size() -> None:
    """``tokenizer.use_tokenizer_vocab_size`` (or no ``model.vocab_size``): the model trains the
    tokenizer's vocabulary padded as Bridge's own setup() and provider pad it (their functions,
    the recipe's divisor x the healthy TP degree), not the preset ``model.vocab_size``; a
    tokenizer that cannot be built is one line naming the field."""
    from nemo_nutp.compat.bridge_cpu import install_import_shim

    install_import_shim()
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    pad = ["tokenizer.vocab_size=250", "model.make_vocab_size_divisible_by=100"]
    want = calculate_padded_vocab_size(
        build_tokenizer(load_bridge_job(RECIPE, str(TINY), [*BASE, *pad]).bridge.tokenizer)
        .vocab_size, 100, 2)
    assert want != 256  # the preset model.vocab_size of the tiny YAML
    for how in ("tokenizer.use_tokenizer_vocab_size=true", "model.vocab_size=null"):
        job = load_bridge_job(RECIPE, str(TINY), [*BASE, *pad, how])
        assert job.nutp.model.vocab_size == job.bridge.model.vocab_size == want, how
    with pytest.raises(ValueError) as e:
        load_bridge_job(RECIPE, str(TINY), [
            *BASE, "tokenizer.use_tokenizer_vocab_size=true",
            "tokenizer.tokenizer_type=SentencePieceTokenizer",
            "tokenizer.tokenizer_model=/nonexistent/tokenizer.model"])
    assert str(e.value).startswith("tokenizer.use_tokenizer_vocab_size=True: ") and \
        "\n" not in str(e.value), str(e.value)
