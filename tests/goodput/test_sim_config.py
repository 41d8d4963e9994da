"""The simulator's config spells the job's keys: ``sim.cluster`` and ``sim.parallel`` are the
job's ClusterSpec and ParallelSpec; the previous release's flat keys map with a warning."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from nemo_nutp.config.schema import config_dir
from nemo_nutp.goodput.config import SIM_RENAMED, SimConfig, load_sim_config


@pytest.mark.parametrize(("old", "value"), [
    ("num_gpus", 1024), ("domain_size", 64), ("gpus_per_node", 8), ("hardware", "h100_nvl8"),
    ("tp_base", 16), ("pp", 2), ("min_tp", 4)])
def test_old_flat_key_on_the_command_line_maps_with_a_warning(old: str, value: object) -> None:
    new = SIM_RENAMED[old]
    with pytest.warns(FutureWarning, match=rf"^sim\.{old} is deprecated: use sim\.{new}\b"):
        cfg = load_sim_config([f"sim.{old}={value}"])
    section, key = new.split(".")
    assert getattr(getattr(cfg, section), key) == value
    ref = load_sim_config([f"sim.{new}={value}"])
    assert cfg == ref


def test_old_and_new_key_set_differently_on_the_command_line_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"^sim\.num_gpus=1024: deprecated name of "
                       r"sim\.cluster\.num_gpus, which the command line also sets \(2048\)"):
        load_sim_config(["sim.num_gpus=1024", "sim.cluster.num_gpus=2048"])
    with pytest.warns(FutureWarning):  # the same value twice is no conflict
        cfg = load_sim_config(["sim.tp_base=16", "sim.parallel.tp_base=16"])
    assert cfg.parallel.tp_base == 16


def _configs(tmp_path: Path, **scenarios: str) -> Path:
    root = tmp_path / "configs"
    shutil.copytree(config_dir(), root)
    for name, text in scenarios.items():
        (root / "sim" / f"{name}.yaml").write_text(text)
    return root


def _load(overrides: list[str], root: Path) -> tuple[SimConfig, list[str]]:
    """The config and the old names its FutureWarnings name."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_sim_config(overrides, directory=root)
    assert all(w.category is FutureWarning for w in caught)
    return cfg, sorted(str(w.message).split()[0] for w in caught)


def test_old_flat_keys_in_a_scenario_file_map_with_a_warning(tmp_path: Path) -> None:
    root = _configs(
        tmp_path,
        derived="defaults:\n  - paper_32k\n  - _self_\nname: derived\nnum_gpus: 2048\npp: 2\n",
        alone="name: alone\nnum_gpus: 512\ndomain_size: 16\ntp_base: 16\nhardware: h100_nvl8\n",
        newer="defaults:\n  - derived\n  - _self_\nname: newer\nparallel:\n  pp: 4\n")
    cfg, warned = _load(["sim=derived"], root)
    assert warned == ["sim.num_gpus", "sim.pp"]
    assert (cfg.cluster.num_gpus, cfg.parallel.pp, cfg.parallel.tp_base) == (2048, 2, 32)
    cfg, warned = _load(["sim=alone"], root)
    assert warned == ["sim.domain_size", "sim.hardware", "sim.num_gpus", "sim.tp_base"]
    assert (cfg.cluster.num_gpus, cfg.cluster.domain_size, cfg.parallel.tp_base,
            cfg.cluster.hardware) == (512, 16, 16, "h100_nvl8")
    cfg, _ = _load(["sim=newer"], root)  # a later file's new name beats its base's old one
    assert (cfg.cluster.num_gpus, cfg.parallel.pp) == (2048, 4)
    cfg, _ = _load(["sim=derived", "sim.cluster.num_gpus=4096"], root)  # the command line wins
    assert cfg.cluster.num_gpus == 4096


def test_old_and_new_key_set_differently_in_one_file_is_an_error(tmp_path: Path) -> None:
    root = _configs(tmp_path, both="defaults:\n  - paper_32k\n  - _self_\nname: both\n"
                                   "num_gpus: 2048\ncluster:\n  num_gpus: 4096\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=r"^sim\.num_gpus=2048: deprecated name of "
                           r"sim\.cluster\.num_gpus, which both\.yaml also sets \(4096\)"):
            load_sim_config(["sim=both"], directory=root)


@pytest.mark.parametrize(("override", "message"), [
    ("sim.cluster.num_gpus=0", r"sim\.cluster\.num_gpus=0: must be"),
    ("sim.cluster.num_gpus=30", r"sim\.cluster\.gpus_per_node=4: must divide "
                                r"sim\.cluster\.num_gpus=30"),
    ("sim.cluster.num_gpus=abc", r"sim\.cluster\.num_gpus: Value 'abc'"),
    ("sim.cluster.hardware=null", r"sim\.cluster\.hardware=None: the simulator needs a "
                                  r"hardware file"),
    ("sim.parallel.min_tp=64", r"sim\.parallel\.min_tp=64: exceeds sim\.parallel\.tp_base=32"),
    ("sim.parallel.tp_base=64", r"sim\.parallel\.tp_base=64: exceeds "
                                r"sim\.cluster\.domain_size=32"),
    ("+sim.parallel.dp=4", r"sim\.parallel\.dp=4: not modelled by the simulator"),
    ("+sim.cluster.bogus=1", r"sim\.cluster\.bogus"),
])
def test_bad_cluster_or_parallel_value_names_the_sim_key(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^{message}") as e:
        load_sim_config([override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["paper_32k", "nvl72_gb200", "scale_131k"])
def test_shipped_scenarios_spell_only_the_new_keys(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cfg = load_sim_config([f"sim={name}"])
    assert cfg.name == name and cfg.cluster.hardware is not None
