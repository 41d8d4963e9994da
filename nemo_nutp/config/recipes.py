"""Recipes: ready jobs in ``recipes/``, each deriving from ``recipes/base_pretrain.yaml``.

A recipe is a Hydra primary config that lives in ``recipes/`` and picks the groups of
``configs/`` by absolute path (``/model: llama3_70b``, ``override /cluster: nvl72``). Loading one
therefore composes with ``recipes/`` as the config directory and ``configs/`` on Hydra's search
path; the result goes through the same strict ``load_config`` (unknown keys and wrong types are
``ValueError`` naming the key). Overrides apply on top, group overrides included
(``recipe=llama3_8b_h100 cluster=node_pair``).

Contract: a recipe named ``NAME`` is the file ``recipes/NAME.yaml``; ``load_job`` with
``recipe=None`` and no ``recipe=`` override is exactly ``load_config``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..common import env
from ..layout.specs import bad_value
from .loading import load_config
from .schema import JobConfig, config_dir

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
"""The shipped recipes (repository layout); ``NUTP_RECIPES_DIR`` overrides it."""


def recipes_dir() -> Path:
    return Path(os.environ.get(env.RECIPES_DIR, RECIPES_DIR))


def list_recipes(directory: Path | None = None) -> list[str]:
    """Names of the recipes (``*.yaml`` stems), sorted."""
    return sorted(p.stem for p in (directory or recipes_dir()).glob("*.yaml"))


def searchpath_override(configs: str | Path) -> str:
    """The Hydra override that puts the ``configs/`` tree on the search path."""
    return f"hydra.searchpath=[file://{configs}]"


def load_recipe(name: str, overrides: list[str] | None = None, *,
                directory: Path | None = None, configs: Path | None = None) -> JobConfig:
    """Compose ``recipes/<name>.yaml`` (groups from ``configs/``) + overrides into a JobConfig."""
    directory = directory or recipes_dir()
    if not (directory / f"{name}.yaml").is_file():
        raise ValueError(f"recipe={name!r}: no {name}.yaml in {directory} "
                         f"(known: {', '.join(list_recipes(directory)) or 'none'})")
    path = (configs or config_dir()).resolve()
    return load_config([searchpath_override(path), *(overrides or [])], config_name=name,
                       directory=directory)


def split_recipe(overrides: list[str], recipe: str | None = None
                 ) -> tuple[str | None, list[str]]:
    """Pull a ``recipe=NAME`` override out of a Hydra override list (``--recipe`` wins)."""
    rest = [o for o in overrides if not o.startswith("recipe=")]
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")]
    if len(named) > 1 or (named and recipe and named[0] != recipe):
        raise ValueError(f"recipe: given more than once ({[*named, recipe]})")
    return recipe or (named[0] if named else None), rest


def load_job(overrides: list[str] | None = None, *, config_name: str = "config",
             recipe: str | None = None, mla: bool = False) -> JobConfig:
    """The job of ``nutp plan``/``nutp sbatch``: a recipe (``recipe=NAME`` or ``recipe``) plus
    overrides, or the primary config ``configs/<config_name>.yaml`` plus overrides.
    ``mla``: the model may carry multi-latent attention (``model.kv_lora_rank``: ``nutp-bridge``,
    whose provider's MoE NUTP builds it on, ``bridge_run.mla_of``); ``nutp-train`` has no MoE
    keys and refuses it."""
    name, rest = split_recipe(list(overrides or []), recipe)
    if name is None:
        cfg = load_config(rest, config_name=config_name)
    elif config_name != "config":
        raise ValueError(f"recipe={name!r}: cannot be combined with --config-name {config_name}")
    else:
        cfg = load_recipe(name, rest)
    if cfg.model.kv_lora_rank is not None and not mla:
        raise bad_value("model.kv_lora_rank", cfg.model.kv_lora_rank,
                        "multi-latent attention is not built in nutp-train yet (NUTP builds it "
                        "with MoE: model/mla.py, build_session(moe=..., mla=...), nutp-bridge)")
    return cfg
