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
from nemo_nutp.config.recipes import RECIPES_DIR, list_recipes, load_job, load_recipe
from nemo_nutp.config.schema import CONFIG_DIR, validate_yaml_file
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


@pytest.mark.parametrize("path", HEALTH_FILES, ids=_rel(HEALTH_FILES))
def test_health_report_loads(path: Path) -> None:
    assert HealthReport.from_file(path).failed_gpus


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
        assert len(raw) <= 4, f"{name} should state only its differences"


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
