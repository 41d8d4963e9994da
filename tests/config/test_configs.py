"""Every shipped YAML file loads strictly into its dataclass schema; bad keys and types fail.

Files are found by globbing configs/ and recipes/, so a new file is covered (or, if it fits no
known kind, fails ``test_every_yaml_file_is_covered``) without touching this test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_nutp.config import JobConfig, load_config, plan_request
from nemo_nutp.config.loading import validate_yaml_file
from nemo_nutp.config.recipes import RECIPES_DIR, list_recipes, load_job, load_recipe
from nemo_nutp.config.schema import CONFIG_DIR
from nemo_nutp.goodput.config import HardwareSpec, SimConfig, load_sim_config, load_yaml_strict
from nemo_nutp.layout import HealthReport, build_plan

SIM_PRIMARY = "simulate"


def _job_groups() -> list[str]:
    """Config groups picked by the primary job config's defaults list."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"))["defaults"]
    return [next(iter(d)) for d in defaults if isinstance(d, dict)]


def _group_files(group: str) -> list[Path]:
    return sorted((CONFIG_DIR / group).glob("*.yaml"))


def _rel(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(CONFIG_DIR)) for p in paths]


JOB_GROUP_FILES = [p for g in _job_groups() for p in _group_files(g)]
PRIMARY = sorted(p for p in CONFIG_DIR.glob("*.yaml") if p.stem != SIM_PRIMARY)
SIM_FILES = sorted((CONFIG_DIR / "sim").glob("*.yaml"))
HARDWARE_FILES = sorted((CONFIG_DIR / "sim" / "hardware").glob("*.yaml"))
HEALTH_FILES = sorted((CONFIG_DIR / "health").glob("*.yaml"))
HEALTH_REPORTS = sorted({CONFIG_DIR / str(r) for p in HEALTH_FILES
                         if (r := OmegaConf.load(p).get("report"))})
"""The health report files the ``health`` group's options name (``report.yaml`` ->
``health/example.yaml``, itself also an option of the group)."""


def test_every_yaml_file_is_covered() -> None:
    covered = {*JOB_GROUP_FILES, *PRIMARY, *SIM_FILES, *HARDWARE_FILES, *HEALTH_FILES,
               CONFIG_DIR / f"{SIM_PRIMARY}.yaml"}
    every = set(CONFIG_DIR.rglob("*.yaml")) | set(CONFIG_DIR.rglob("*.yml"))
    assert every - covered == set(), "YAML files no test loads"
    assert len(JOB_GROUP_FILES) >= 10 and _job_groups()


@pytest.mark.parametrize("path", PRIMARY, ids=_rel(PRIMARY))
def test_primary_job_config_loads(path: Path) -> None:
    assert isinstance(load_config([], config_name=path.stem), JobConfig)
    assert isinstance(validate_yaml_file(path), JobConfig)


@pytest.mark.parametrize("path", PRIMARY, ids=_rel(PRIMARY))
def test_primary_job_config_sets_only_deviations(path: Path) -> None:
    """A primary config holds group picks and what differs from the dataclass defaults, nothing
    that repeats a default (docs/config.md documents the keys)."""
    defaults = OmegaConf.to_container(OmegaConf.structured(JobConfig))
    same: list[str] = []

    def walk(node: dict, ref: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and isinstance(ref.get(key), dict):
                walk(value, ref[key], f"{prefix}{key}.")
            elif key in ref and ref[key] == value:
                same.append(f"{prefix}{key}")

    text = OmegaConf.to_container(OmegaConf.load(path))
    walk({k: v for k, v in text.items() if k != "defaults"}, defaults, "")
    assert not same, f"{path.name} repeats the default of {same}"


def test_config_dataclasses_are_never_rewritten() -> None:
    """The loader normalises before a dataclass is built; no frozen config is patched after."""
    import nemo_nutp.config as pkg

    patched = [p.name for p in sorted(Path(pkg.__file__).parent.glob("*.py"))
               if "object.__setattr__" in p.read_text()]
    assert not patched, f"object.__setattr__ on a frozen config in {patched}"


@pytest.mark.parametrize("path", JOB_GROUP_FILES, ids=_rel(JOB_GROUP_FILES))
def test_group_option_loads_into_job_config(path: Path) -> None:
    group = path.parent.name
    cfg = load_config([f"{group}={path.stem}"])
    node = getattr(cfg, group)
    for key, value in OmegaConf.to_container(OmegaConf.load(path)).items():
        if key != "defaults":
            assert getattr(node, key) == value, f"{group}.{key}"


def test_simulator_primary_loads() -> None:
    assert isinstance(load_sim_config([]), SimConfig)


@pytest.mark.parametrize("path", SIM_FILES, ids=_rel(SIM_FILES))
def test_sim_scenario_loads(path: Path) -> None:
    cfg = load_sim_config([f"sim={path.stem}"])
    assert isinstance(cfg, SimConfig) and cfg.name == path.stem


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=_rel(HARDWARE_FILES))
def test_hardware_loads(path: Path) -> None:
    assert isinstance(load_yaml_strict(HardwareSpec, path, "hardware"), HardwareSpec)


@pytest.mark.parametrize("path", HEALTH_REPORTS, ids=_rel(HEALTH_REPORTS))
def test_health_report_loads(path: Path) -> None:
    assert HealthReport.from_file(path).failed_gpus
    assert path in HEALTH_FILES  # an option of the health group too


# -- health (formerly failures) ------------------------------------------------------------------
def test_health_failed_gpus_drive_the_plan() -> None:
    """``health.*`` (group and keys) say which GPUs are down: the plan leaves them out."""
    assert "health" in _job_groups() and HEALTH_REPORTS
    plan = build_plan(plan_request(load_config(["health.failed_gpus=[2]"])))
    assert plan.request.health.failed_gpus == (2,) and 2 not in plan.rank_to_gpu
    assert plan.world_size == 7
    assert build_plan(plan_request(load_config(["health=none"]))).world_size == 8
    report = load_config(["health=report"]).health
    assert report.as_report().failed_gpus == (3, 17, 40, 41)


def test_failures_still_maps_to_health_with_one_warning_each(tmp_path: Path) -> None:
    """The previous release's ``failures`` (group choice, keys, a YAML's top-level section, the
    group in a defaults list) becomes ``health`` with a FutureWarning naming both."""
    with pytest.warns(FutureWarning, match=r"^failures=none is deprecated: use health=none"):
        assert load_config(["failures=none"]) == load_config(["health=none"])
    with pytest.warns(FutureWarning) as caught:
        cfg = load_config(["failures.failed_gpus=[2]", "failures.slow_gpus={1: 0.5}"])
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "failures.failed_gpus is deprecated: use health.failed_gpus",
        "failures.slow_gpus is deprecated: use health.slow_gpus"]
    assert cfg == load_config(["health.failed_gpus=[2]", "health.slow_gpus={1: 0.5}"])
    with pytest.warns(FutureWarning, match=r"^failures=report is deprecated"):
        assert load_job(["recipe=llama3_8b_h100", "failures=report"]).health.report == \
            "health/example.yaml"
    job = tmp_path / "job.yaml"
    job.write_text("failures:\n  failed_gpus: [3]\n")
    with pytest.warns(FutureWarning, match=r"^the section failures is deprecated: use health"):
        assert validate_yaml_file(job).health.failed_gpus == [3]
    recipes = tmp_path / "recipes"
    shutil.copytree(RECIPES_DIR, recipes)
    (recipes / "old.yaml").write_text(
        "defaults:\n  - nutp_defaults\n  - /model: tiny\n  - /cluster: cpu_local\n"
        "  - /failures: one_gpu\n  - _self_\n")
    with pytest.warns(FutureWarning, match=r"^/failures: one_gpu is deprecated: use "
                                           r"/health: one_gpu"):
        assert load_recipe("old", directory=recipes).health == load_config([]).health


@pytest.mark.parametrize(("overrides", "yaml", "match"), [
    (["failures.failed_gpus=[2]", "health.failed_gpus=[3]"], None,
     r"^failures\.failed_gpus='\[2\]': deprecated name of health\.failed_gpus, which is also "
     r"set \(health\.failed_gpus=\[3\]\): set health\.failed_gpus only$"),
    (["failures=none", "health=report"], None,
     r"^failures='none': deprecated name of health, which is also set \(health=report\)"),
    ([], "failures:\n  failed_gpus: [3]\nhealth:\n  failed_gpus: [4]\n",
     r"^failures\.failed_gpus=\[3\]: deprecated name of health\.failed_gpus, which is also "
     r"set \(health\.failed_gpus=\[4\]\)"),
    ([], "defaults:\n  - base_pretrain\n  - /failures: one_gpu\n  - _self_\n",
     r"^/failures='one_gpu': deprecated group name of /health, which is also chosen "
     r"\(/health: none\)"),
])
def test_failures_and_health_set_differently_is_one_error_line(
        tmp_path: Path, overrides: list[str], yaml: str | None, match: str) -> None:
    shutil.copytree(RECIPES_DIR, tmp_path, dirs_exist_ok=True)
    (tmp_path / "both.yaml").write_text(yaml or "defaults:\n  - base_pretrain\n  - _self_\n")
    with pytest.raises(ValueError, match=match) as e:
        load_recipe("both", overrides, directory=tmp_path)
    assert "\n" not in str(e.value)


def test_failures_and_health_set_alike_load() -> None:
    with pytest.warns(FutureWarning) as caught:
        cfg = load_config(["failures.failed_gpus=[2]", "health.failed_gpus=[2]", "failures=none",
                           "health=none"])
    assert len(caught) == 2
    assert cfg.health.failed_gpus == [2]


# -- recipes -------------------------------------------------------------------------------------
RECIPES = list_recipes()


def test_recipes_exist_and_derive_from_one_base() -> None:
    assert {"base_pretrain", "llama3_8b_h100", "llama3_70b_h100", "llama3_8b_gb200",
            "llama3_70b_gb200"} <= set(RECIPES)
    for name in RECIPES:
        if name == "base_pretrain":
            continue
        raw = OmegaConf.to_container(OmegaConf.load(RECIPES_DIR / f"{name}.yaml"))
        assert raw["defaults"][0] == "base_pretrain", name
        assert len(raw) <= 5, f"{name} should state only its differences"  # 70B: + model recompute


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_and_plans(name: str) -> None:
    cfg = load_recipe(name)
    assert isinstance(cfg, JobConfig)
    assert load_job([f"recipe={name}"]) == cfg == load_job([], recipe=name)
    plan = build_plan(plan_request(cfg))
    assert plan.world_size == cfg.cluster.num_gpus


def test_recipe_differences_are_applied() -> None:
    base, big = load_recipe("base_pretrain"), load_recipe("llama3_70b_gb200")
    assert (base.model.num_layers, big.model.num_layers) == (32, 80)
    assert big.cluster.domain_size == 72 and big.parallel.pp == 2
    assert big.train.lr == base.train.lr  # inherited, not copied
    over = load_recipe("llama3_70b_h100", ["cluster=node_pair", "parallel.pp=2"])
    assert over.cluster.num_gpus == 16 and over.parallel.pp == 2 and over.model.num_layers == 80


def test_unknown_recipe_names_the_recipe() -> None:
    with pytest.raises(ValueError, match="recipe='nope'"):
        load_job(["recipe=nope"])


# -- strictness ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("loader", "override", "key"), [
    (load_config, "+train.bogus=1", "train.bogus"),
    (load_config, "train.steps=abc", "train.steps"),
    (load_config, "parallel.tp_base=eight", "parallel.tp_base"),
    (lambda o: load_recipe("llama3_70b_gb200", o), "+model.bogus=1", "model.bogus"),
    (lambda o: load_recipe("llama3_8b_h100", o), "train.lr=fast", "train.lr"),
    (load_sim_config, "+sim.bogus=1", "sim.bogus"),
    (load_sim_config, "sim.trials=abc", "sim.trials"),
    (load_sim_config, "+sim.failures.bogus=1", "sim.failures.bogus"),
])
def test_bad_override_names_the_key(loader, override: str, key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key}\b"):
        loader([override])


@pytest.mark.parametrize(("text", "key"), [
    ("train:\n  bogus: 1\n", "train.bogus"),
    ("parallel:\n  tp_base: eight\n", "parallel.tp_base"),
    ("cluster:\n  num_gpus: [1, 2]\n", "cluster.num_gpus"),
])
def test_bad_yaml_file_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{key}\b"):
        validate_yaml_file(path)


def test_bad_group_option_and_recipe_files_name_the_key(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "cluster" / "bad.yaml").write_text("num_gpus: 8\nbogus_key: 1\n")
    with pytest.raises(ValueError, match=r"^cluster\.bogus_key\b"):
        load_config(["cluster=bad"], directory=configs)
    recipes = tmp_path / "recipes"
    shutil.copytree(RECIPES_DIR, recipes)
    (recipes / "broken.yaml").write_text(
        "defaults:\n  - base_pretrain\n  - _self_\ntrain:\n  global_batch_size: many\n")
    with pytest.raises(ValueError, match=r"^train\.global_batch_size\b"):
        load_recipe("broken", directory=recipes, configs=configs)


def test_bad_hardware_file_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "hw.yaml"
    path.write_text((CONFIG_DIR / "sim" / "hardware" / "h100_nvl8.yaml").read_text()
                    + "bogus: 1\n")
    with pytest.raises(ValueError, match=r"^hardware\.bogus\b"):
        load_yaml_strict(HardwareSpec, path, "hardware")


def test_derived_head_width_follows_the_chosen_model() -> None:
    """kv_channels derives from each model's own hidden/heads (not a schema default)."""
    from nemo_nutp.config import load_config

    assert load_config(["model=tiny"]).model.kv == 8
    assert load_config(["model=llama3_8b"]).model.kv == 128
    assert load_config(["model=llama3_70b", "model.num_attention_heads=32"]).model.kv == 256
    with pytest.raises(ValueError, match=r"model\.hidden_size=63"):
        load_config(["model.hidden_size=63"])


# -- numerics and regularisation -----------------------------------------------------------------
def test_numerics_defaults_load() -> None:
    cfg = load_config([])
    t, m = cfg.train, cfg.model
    assert (t.precision, t.grad_reduce_in_fp32, t.clip_grad) == ("fp32", True, 0.0)
    assert (t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window) == (2.0 ** 32, 1.0, 1000)
    assert (t.check_for_nan_in_grad, t.large_grad_factor, t.large_grad_window) == (True, 10.0, 20)
    assert (m.hidden_dropout, m.attention_dropout) == (0.0, 0.0)


def test_numerics_good_values_load() -> None:
    bf16 = load_config(["train.precision=bf16", "train.grad_reduce_in_fp32=false"]).train
    assert (bf16.precision, bf16.grad_reduce_in_fp32) == ("bf16", False)
    edge = load_config(["train.precision=fp16", "train.initial_loss_scale=65536",
                        "train.min_loss_scale=65536", "train.loss_scale_window=1",
                        "train.large_grad_factor=1.5", "train.large_grad_window=1"]).train
    assert (edge.min_loss_scale, edge.large_grad_factor, edge.large_grad_window) == (
        65536.0, 1.5, 1)
    cfg = load_config(["train.precision=fp16", "model.hidden_dropout=0.1",
                       "model.attention_dropout=0.999", "train.clip_grad=1.0",
                       "train.check_for_nan_in_grad=false"])
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.1, 0.999)
    assert (cfg.train.clip_grad, cfg.train.check_for_nan_in_grad) == (1.0, False)


@pytest.mark.parametrize(("overrides", "key"), [
    (["train.precision=fp8"], "train.precision"),
    (["train.precision=FP16"], "train.precision"),
    (["train.precision=fp16", "train.grad_reduce_in_fp32=false"], "train.grad_reduce_in_fp32"),
    (["train.initial_loss_scale=0"], "train.initial_loss_scale"),
    (["train.initial_loss_scale=inf"], "train.initial_loss_scale"),
    (["train.min_loss_scale=-1"], "train.min_loss_scale"),
    (["train.initial_loss_scale=1024", "train.min_loss_scale=2048"], "train.min_loss_scale"),
    (["train.loss_scale_window=0"], "train.loss_scale_window"),
    (["train.loss_scale_window=1.5"], "train.loss_scale_window"),
    (["train.large_grad_factor=0.5"], "train.large_grad_factor"),
    (["train.large_grad_factor=1"], "train.large_grad_factor"),
    (["train.large_grad_factor=-2"], "train.large_grad_factor"),
    (["train.large_grad_window=0"], "train.large_grad_window"),
    (["train.clip_grad=-0.5"], "train.clip_grad"),
    (["train.clip_grad=nan"], "train.clip_grad"),
    (["train.check_for_nan_in_grad=maybe"], "train.check_for_nan_in_grad"),
    (["model.hidden_dropout=1.0"], "model.hidden_dropout"),
    (["model.hidden_dropout=-0.1"], "model.hidden_dropout"),
    (["model.attention_dropout=1.5"], "model.attention_dropout"),
])
def test_numerics_bad_values_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key}\b"):
        load_config(overrides)


YARN = ["model.position_embedding_type=yarn", "model.yarn_rotary_scaling_factor=4",
        "model.yarn_original_max_position_embeddings=16", "model.yarn_beta_fast=32",
        "model.yarn_beta_slow=1"]


@pytest.mark.parametrize(("overrides", "match"), [
    (["model.rotary_base=1"], r"^model\.rotary_base=1: must be an integer >= 2"),
    (["model.rotary_percent=0"], r"^model\.rotary_percent=0\.0: must be in \(0, 1\]"),
    (["model.rotary_percent=0.1"], r"^model\.rotary_percent=0\.1: rotates 0 of 8 channels"),
    (["model.rope_scaling_factor=0"], r"^model\.rope_scaling_factor=0\.0: must be > 0"),
    (["model.seq_len_interpolation_factor=-1"],
     r"^model\.seq_len_interpolation_factor=-1\.0: must be > 0 or null"),
    (["model.position_embedding_type=learned_absolute", "model.rope_scaling=true"],
     r"^model\.rope_scaling=True: needs model\.position_embedding_type=rope"),
    (["model.activation_func=swish"], r"^model\.activation_func='swish': must be one of"),
    (["model.window_size=[4]"], r"^model\.window_size=\[4\]: must be \[left, right\]"),
    (["model.window_attn_skip_freq=2"], r"^model\.window_attn_skip_freq=2: needs model\.window_"),
    (["model.layernorm_epsilon=0"], r"^model\.layernorm_epsilon=0\.0: must be in \(0, 1\)"),
    (["model.yarn_beta_fast=32"], r"^model\.yarn_beta_fast=32\.0: needs model\.position_"
                                  r"embedding_type=yarn \(is rope\)"),
    ([*YARN[:2]], r"^model\.yarn_original_max_position_embeddings=None: required with "),
    ([*YARN, "model.yarn_beta_fast=0.5"], r"^model\.yarn_beta_fast=0\.5: must be > model\."),
    ([*YARN, "model.rotary_percent=0.5"],
     r"^model\.rotary_percent=0\.5: needs model\.position_embedding_type=rope \(is yarn\)"),
    (["model.softmax_scale=0"], r"^model\.softmax_scale=0\.0: must be > 0 or null"),
    (["model.attn_logit_softcapping=-1"],
     r"^model\.attn_logit_softcapping=-1\.0: must be > 0 or null"),
    (["model.final_logit_softcapping=0"],
     r"^model\.final_logit_softcapping=0\.0: must be > 0 or null"),
    (["model.attn_logit_softcapping=50", "model.core_attention=sdpa"],
     r"^model\.core_attention='sdpa': SDPA cannot softcap the attention scores"),
    (["model.post_layernorm=true", "model.add_bias_linear=true"],
     r"^model\.post_layernorm=True: needs model\.add_bias_linear=false"),
    (["model.embedding_scale_rounded=false"],
     r"^model\.embedding_scale_rounded=False: needs model\.apply_embedding_scaling=true"),
    (["model.rotary_base_local=10000"], r"^model\.rotary_base_local=10000: needs model\.window_"),
    (["model.rotary_base_local=1", "model.window_size=[4,0]"],
     r"^model\.rotary_base_local=1: must be an integer >= 2"),
    (["model.rotary_base_local=10000", "model.window_size=[4,0]", "model.rope_scaling=true"],
     r"^model\.rotary_base_local=10000: with model\.rope_scaling=true"),
    (["model.rotary_base_local=10000", "model.window_size=[4,0]",
      "model.position_embedding_type=none"],
     r"^model\.rotary_base_local=10000: needs model\.position_embedding_type=rope"),
    (["model.rope_scaling_factor_global=8"],
     r"^model\.rope_scaling_factor_global=8\.0: needs model\.rotary_base_local"),
    (["model.rope_scaling_factor_global=0"],
     r"^model\.rope_scaling_factor_global=0\.0: must be > 0"),
    *[([f"model.{name}={v}", "model.transformer_impl=transformer_engine",
        "model.window_size=[4,0]"],
       rf"^model\.transformer_impl='transformer_engine': model\.{name} is built with local")
      for name, v in (("layernorm_zero_centered_gamma", "true"), ("post_layernorm", "true"),
                      ("attn_logit_softcapping", "50"), ("rotary_base_local", "10000"))],
])
def test_model_settings_bad_values_name_the_key(overrides: list[str], match: str) -> None:
    """RoPE, activation and epsilon values that megatron would fail on late, or that would be
    ignored (RoPE beside learned positions), are one line naming the key."""
    with pytest.raises(ValueError, match=match):
        load_config(overrides)


def test_previous_names_still_load_with_one_warning_each() -> None:
    """gated_mlp / add_bias / position_embedding (the previous release's) become megatron's
    names with a FutureWarning naming both; both names set differently is one error line."""
    with pytest.warns(FutureWarning, match=r"^model\.gated_mlp is deprecated: use "
                                           r"model\.gated_linear_unit"):
        m = load_config(["model.gated_mlp=false", "model.add_bias=true",
                         "model.position_embedding=learned_absolute"]).model
    assert (m.gated_linear_unit, m.add_bias_linear, m.position_embedding_type) == (
        False, True, "learned_absolute")
    assert (m.gated_mlp, m.add_bias, m.position_embedding) == (None, None, None)
    with pytest.raises(ValueError, match=r"^model\.add_bias=False: deprecated name of "
                                         r"model\.add_bias_linear, which is also set"):
        load_config(["model.add_bias=false", "model.add_bias_linear=true"])


def test_a_previous_release_checkpoint_marker_is_read_by_the_new_names(tmp_path: Path) -> None:
    from nemo_nutp.checkpoint.store import FORMAT, check_compatible
    from nemo_nutp.config import ModelConfig

    old = {"format": FORMAT, "model": {"gated_mlp": True, "add_bias": False,
                                       "position_embedding": "rope", "hidden_size": 64}}
    check_compatible(old, ModelConfig(), tmp_path)  # the tiny defaults: the same model
    with pytest.raises(ValueError, match=r"^model\.gated_linear_unit=False: checkpoint"):
        check_compatible(old, ModelConfig(gated_linear_unit=False), tmp_path)


def test_model_settings_load_with_megatron_names() -> None:
    job = load_config(["model=llama3_8b", "model.rope_scaling=true",
                       "model.activation_func=silu", "model.layernorm_epsilon=1e-6",
                       "model.add_qkv_bias=true"])
    m = job.model
    assert (m.rotary_base, m.rope_scaling, m.rope_scaling_factor) == (500000, True, 8.0)
    assert (m.activation_func, m.layernorm_epsilon, m.qkv_bias) == ("silu", 1e-6, True)
    y = load_config([*YARN, "model.rotary_base=150000"]).model
    assert (y.position_embedding_type, y.rotary_base, y.yarn_rotary_scaling_factor) == (
        "yarn", 150000, 4.0)
    nope = load_config(["model.position_embedding_type=none"]).model
    assert nope.position_embedding_type == "none"
    w = load_config(["model.window_size=[4096,0]", "model.window_attn_skip_freq=6"]).model
    assert (w.window_size, w.window_attn_skip_freq) == ((4096, 0), 6) and hash(w)


def test_gemma_settings_load_with_megatron_and_bridge_names() -> None:
    """Gemma 2/3's settings (megatron's and Bridge's provider names) load from YAML overrides
    and reach megatron's TransformerConfig (megatron's fields) or the NUTP layers (Bridge's)."""
    from nemo_nutp.model.build import transformer_config

    g = load_config(["model.layernorm_zero_centered_gamma=true", "model.post_layernorm=true",
                     "model.softmax_scale=0.0625", "model.attn_logit_softcapping=50",
                     "model.final_logit_softcapping=30", "model.apply_embedding_scaling=true",
                     "model.embedding_scale_rounded=false", "model.window_size=[511,0]",
                     "model.window_attn_skip_freq=6", "model.rotary_base=1000000",
                     "model.rotary_base_local=10000",
                     "model.rope_scaling_factor_global=8"]).model
    assert (g.rotary_base_local, g.rope_scaling_factor_global, g.post_layernorm) == (
        10000, 8.0, True) and hash(g)
    c = transformer_config(g, degree=1, cuda=False)
    assert (c.layernorm_zero_centered_gamma, c.softmax_scale) == (True, 0.0625)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping,  # type: ignore[attr-defined]
            c.apply_embedding_scaling, c.embedding_scale_rounded) == (  # type: ignore[attr-defined]
        50.0, 30.0, True, False)


@pytest.mark.parametrize(("overrides", "match"), [
    (["model.kv_channels=7"], r"^model\.kv_channels=7: RoPE needs an even head dimension"),
    (["model.hidden_size=72", "model.num_attention_heads=8"],
     r"^model\.hidden_size=72: RoPE needs an even head dimension \(72/8 heads=9\)"),
])
def test_rope_needs_an_even_head_dimension(overrides: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(overrides)
    learned = load_config([*overrides, "model.position_embedding_type=learned_absolute"])
    assert learned.model.kv % 2 == 1
    # an explicit even kv_channels overrides an odd hidden/heads under RoPE
    assert load_config(["model.hidden_size=72", "model.kv_channels=8"]).model.kv == 8


def test_bad_numerics_fail_the_cli_before_anything_runs(tmp_path: Path) -> None:
    """nutp-train turns the schema's ValueError into exit 2 naming the key, before any spawn."""
    from tests.helpers.launch import run_train

    out = tmp_path / "never"
    r = run_train([f"output.dir={out}", "train.precision=fp8"], timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "train.precision='fp8'" in r.stdout + r.stderr, (r.stdout, r.stderr)
    assert not out.exists()


@pytest.mark.parametrize(("overrides", "match"), [
    (["train.lr_decay_style=cos"], r"^train\.lr_decay_style='cos': must be one of"),
    (["train.lr_warmup_iters=30"], r"^train\.lr_warmup_iters=30: must be < train\.steps=30"),
    (["train.lr_warmup_iters=4", "train.lr_decay_iters=4"],
     r"^train\.lr_warmup_iters=4: must be < train\.lr_decay_iters=4"),
    (["train.min_lr=1"], r"^train\.min_lr=1\.0: must be in \[0, train\.lr="),
    (["train.lr_decay_style=WSD"], r"^train\.lr_wsd_decay_iters=None: required with"),
    (["train.lr_wsd_decay_iters=3"], r"^train\.lr_wsd_decay_iters=3: needs train\.lr_decay_"),
])
def test_schedule_bad_values_name_the_key(overrides: list[str], match: str) -> None:
    """What megatron's OptimizerParamScheduler would assert on, one line before any group."""
    with pytest.raises(ValueError, match=match):
        load_config(overrides)


def test_schedule_loads_with_megatron_names() -> None:
    from nemo_nutp.train.schedule import schedule_of

    t = load_config(["train.lr_warmup_iters=3", "train.lr_decay_style=cosine",
                     "train.min_lr=3e-4", "train.steps=13"]).train
    s = schedule_of(t)
    assert (s.warmup_iters, s.decay_style, s.decay_iters, s.min_lr) == (3, "cosine", 13, 3e-4)
    assert s.lr_at(0) == 0.0 and s.lr_at(3) == pytest.approx(t.lr) and s.lr_at(13) == 3e-4
    assert s.lr_at(8) == pytest.approx(3e-4 + (t.lr - 3e-4) * 0.5)  # half way: cos(pi/2)


@pytest.mark.parametrize(("overrides", "match"), [
    (["train.eval_interval=-1"], r"^train\.eval_interval=-1: must be an integer >= 0"),
    (["train.eval_interval=2", "train.eval_iters=0"], r"^train\.eval_iters=0: must be a "),
    (["train.eval_interval=2", "train.data_path=/x"],
     r"^train\.valid_data_path=None: required for evaluation"),
    (["train.valid_data_path=/x"], r"^train\.valid_data_path='/x': needs train\.eval_interval"),
])
def test_evaluation_bad_values_name_the_key(overrides: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(overrides)


@pytest.mark.parametrize("overrides", [
    ["recovery.spares=-1"],
    ["recovery.spares=1"],  # restart mode: no standby processes
    ["recovery.enabled=true", "recovery.mode=live", "checkpoint.interval=2", "recovery.spares=1",
     "train.distributed_optimizer=true"],
    ["recovery.enabled=true", "recovery.mode=live", "checkpoint.interval=2", "recovery.spares=1",
     "nutp.replicas=[2,2]"],
])
def test_spares_bad_values_name_the_key(overrides: list[str]) -> None:
    with pytest.raises(ValueError, match=r"recovery\.spares="):
        load_config(overrides)


def test_spares_hold_back_the_last_slices() -> None:
    """``recovery.spares=1`` on three 4-GPU slices: the plan trains on GPUs 0-7, GPUs 8-11 are
    held back (idle healthy GPUs of the plan); all slices as spares is refused."""
    from nemo_nutp.config.derived import plan_request
    from nemo_nutp.layout import build_plan

    live = ["recovery.enabled=true", "recovery.mode=live", "checkpoint.interval=2",
            "health=none", "cluster.num_gpus=12", "cluster.gpus_per_node=4", "parallel.tp_base=4"]
    plan = build_plan(plan_request(load_config([*live, "recovery.spares=1"])))
    assert plan.rank_to_gpu == tuple(range(8)) and plan.idle_healthy_gpus == 4
    assert plan.request.health.reserved_gpus == (8, 9, 10, 11) and plan.full_replicas == 2
    with pytest.raises(ValueError, match=r"recovery\.spares=3"):
        plan_request(load_config([*live, "recovery.spares=3"]))
