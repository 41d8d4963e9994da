"""Loading a job config: Hydra composes YAML + overrides, the schema checks them.

``load_config(overrides)`` composes ``configs/config.yaml`` (or another primary config) with the
Hydra compose API and merges it onto ``OmegaConf.structured(JobConfig)`` — unknown keys and wrong
types fail there, naming the full key. A deprecated section name (``SECTION_ALIASES``:
``failures`` -> ``health``) is mapped before: in the overrides before Hydra composes
(``rename_overrides``), in the composed YAML before the merge (``_rename_sections``).
``normalise`` then maps deprecated key names to the surviving ones (one warning line each) and
spellings to their canonical form on the plain dict, before any dataclass is built; the
dataclasses' ``__post_init__`` check values (``config/schema.py``). Nothing here creates a
process group.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..layout.specs import bad_value
from .derived import fit_cpu_cluster
from .hardware import writable_dir_check
from .schema import (
    GRAD_REDUCE_DTYPES,
    RENAMED,
    RESUME_ALIASES,
    JobConfig,
    ModelConfig,
    config_dir,
)

SECTION_ALIASES = {"failures": "health"}
"""Deprecated section names of the job config, accepted for one release: the command line's
group choice (``failures=one_gpu``) and keys (``failures.failed_gpus=[3]``), a YAML's top-level
section and a defaults list's group (``/failures: none``) become the new name's, one
``FutureWarning`` line each."""

_OVERRIDE_PREFIXES = ("++", "+", "~")


def _deprecated(old: str, new: str, where: str) -> None:
    """One warning line naming the old and the new name (``stacklevel``: ``load_config``'s
    caller, through ``rename_overrides`` or ``_rename_sections``)."""
    warnings.warn(f"{old} is deprecated: use {new} ({where}); the old name goes in the next "
                  "release", FutureWarning, stacklevel=4)


def _split_override(text: str) -> tuple[str, str, str | None]:
    """(``+``/``++``/``~`` prefix, key, value or None) of a Hydra override."""
    prefix = next((p for p in _OVERRIDE_PREFIXES if text.startswith(p)), "")
    key, sep, value = text[len(prefix):].partition("=")
    return prefix, key, value if sep else None


def rename_overrides(overrides: list[str]) -> list[str]:
    """The overrides with deprecated section names (``SECTION_ALIASES``) mapped, before Hydra
    composes: ``failures=<option>`` -> ``health=<option>``, ``failures.<key>=...`` ->
    ``health.<key>=...``, one warning line each. The old and the new name both given, with
    different values: a ``ValueError`` naming both."""
    new_values = {}
    for text in overrides:
        prefix, key, value = _split_override(text)
        if key.split(".", 1)[0] in SECTION_ALIASES.values():
            new_values[key] = value
    out = []
    for text in overrides:
        prefix, key, value = _split_override(text)
        head, dot, rest = key.partition(".")
        if head not in SECTION_ALIASES:
            out.append(text)
            continue
        new = SECTION_ALIASES[head] + dot + rest
        if new in new_values and new_values[new] != value:
            raise bad_value(key, value, f"deprecated name of {new}, which is also set "
                            f"({new}={new_values[new]}): set {new} only")
        shown = "" if dot or value is None else f"={value}"  # a group choice: with its option
        _deprecated(key + shown, new + shown,
                    f"the section {head} was renamed {SECTION_ALIASES[head]}")
        out.append(f"{prefix}{new}" + ("" if value is None else f"={value}"))
    return out


def _rename_sections(raw: Any, choices: Any) -> None:
    """A composed config's deprecated sections, in place, one warning line each: the deprecated
    group in a defaults list (``/failures: <option>``, composed into the new section: see
    ``_register_defaults``; the new group chosen too, another option: a ``ValueError`` naming
    both) and a YAML's top-level ``failures:`` block, whose keys move to the new section (a key
    the new section sets to another value than the schema's default too: a ``ValueError``
    naming both)."""
    for old, new in SECTION_ALIASES.items():
        if old in choices:
            if new in choices and choices[new] != choices[old]:
                raise bad_value(f"/{old}", choices[old], f"deprecated group name of /{new}, "
                                f"which is also chosen (/{new}: {choices[new]}): choose /{new} "
                                "only")
            _deprecated(f"/{old}: {choices[old]}", f"/{new}: {choices[old]}",
                        f"in a defaults list; the group {old} was renamed {new}")
        if old not in raw:
            continue
        node = OmegaConf.to_container(raw.pop(old), resolve=False)
        if not isinstance(node, dict):
            raise bad_value(old, node, f"deprecated name of the section {new}: must be a mapping "
                            f"of {new}.* keys")
        default = OmegaConf.to_container(OmegaConf.structured(JobConfig))[new]  # type: ignore
        assert isinstance(default, dict)
        target = raw.get(new)
        have = OmegaConf.to_container(target) if target is not None else {}
        assert isinstance(have, dict)
        for key, v in node.items():
            k = str(key)
            if k in have and have[k] != default.get(k) and have[k] != v:
                raise bad_value(f"{old}.{k}", v, f"deprecated name of {new}.{k}, which is also "
                                f"set ({new}.{k}={have[k]!r}): set {new}.{k} only")
        _deprecated(f"the section {old}", new, f"a YAML's top-level {old}: block; the section "
                    f"was renamed {new}")
        raw[new] = OmegaConf.merge(target if target is not None else {}, node)


def normalise(data: dict[str, Any]) -> None:
    """The merged config as plain data, in place: deprecated names mapped, spellings made
    canonical, so that the dataclasses only check."""
    _model_names(data["model"])
    _grad_reduce(data["train"], data["sync"])
    ck = data["checkpoint"]
    iv = ck["interval"]
    if isinstance(iv, str) and iv.strip().lower() == "auto":
        ck["interval"] = "auto"
    mode = str(ck["resume"]).lower()
    if mode in RESUME_ALIASES or mode in ("auto", "required", "never"):
        ck["resume"] = RESUME_ALIASES.get(mode, mode)


def _model_names(model: dict[str, Any]) -> None:
    """The previous release's ``model.*`` names: one warning each, the value moved to
    megatron's name (both set differently: an error naming them). YAML's list
    ``window_size`` becomes a tuple (the config stays hashable)."""
    for old, new in RENAMED.items():
        value = model[old]
        if value is None:
            continue
        default = ModelConfig.__dataclass_fields__[new].default
        if model[new] != default and model[new] != value:
            raise bad_value(f"model.{old}", value, f"deprecated name of model.{new}, which "
                            f"is also set ({model[new]!r}): set model.{new} only")
        warnings.warn(f"model.{old} is deprecated: use model.{new} (megatron-core's name); "
                      "the old name goes in the next release", FutureWarning, stacklevel=4)
        model[new], model[old] = value, None
    if isinstance(model["window_size"], list):
        model["window_size"] = tuple(model["window_size"])


def _grad_reduce(train: dict[str, Any], sync: dict[str, Any]) -> None:
    """The deprecated ``sync.grad_reduce_dtype`` becomes ``train.grad_reduce_in_fp32`` (one
    warning line naming both; both set inconsistently: an error naming both); fp32 parameters
    reduce in fp32 whatever it says (megatron's rule)."""
    dt = sync["grad_reduce_dtype"]
    if dt is not None:
        if dt not in GRAD_REDUCE_DTYPES:
            raise bad_value("sync.grad_reduce_dtype", dt, f"must be one of {GRAD_REDUCE_DTYPES} "
                            "(deprecated: use train.grad_reduce_in_fp32)")
        if dt == "fp32" and not train["grad_reduce_in_fp32"] and train["precision"] != "fp32":
            raise bad_value("sync.grad_reduce_dtype", dt, "contradicts train.grad_reduce_in_fp32="
                            "false (its deprecated name: set train.grad_reduce_in_fp32 only)")
        if dt == "bf16" and train["precision"] != "bf16":
            raise bad_value("sync.grad_reduce_dtype", dt,
                            f"needs train.precision=bf16 (got {train['precision']!r})")
        warnings.warn("sync.grad_reduce_dtype is deprecated: use train.grad_reduce_in_fp32 "
                      "(megatron's name); the old name goes in the next release",
                      FutureWarning, stacklevel=4)
        train["grad_reduce_in_fp32"] = dt == "fp32"
        sync["grad_reduce_dtype"] = None
    if train["precision"] == "fp32":
        train["grad_reduce_in_fp32"] = True


def _build(cls: type, data: dict[str, Any]) -> Any:
    """A dataclass from plain data, nested sections first (their checks run in field order)."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:
            proto = f.default_factory()
            if dataclasses.is_dataclass(proto):
                value = _build(type(proto), value)
        elif isinstance(value, list):  # a list of sections (``recovery.faults``)
            item = _list_item(cls, f.name)
            if item is not None:
                value = [_build(item, v) if isinstance(v, dict) else v for v in value]
        kwargs[f.name] = value
    return cls(**kwargs)


def _list_item(cls: type, name: str) -> type | None:
    """The dataclass a ``list[...]`` field of ``cls`` holds, or None."""
    hint = typing.get_type_hints(cls).get(name)
    if typing.get_origin(hint) is not list:
        return None
    (arg,) = typing.get_args(hint)
    return arg if isinstance(arg, type) and dataclasses.is_dataclass(arg) else None


def _register_defaults() -> None:
    """Every schema key with its default, as the config ``nutp_defaults`` that primary configs
    list first: Hydra then accepts an override of any schema key (not only those a YAML file
    mentions). Types are enforced after composition, by the structured merge. The deprecated
    group of ``SECTION_ALIASES`` (``/failures: <option>``) holds the new group's options
    (``configs/health/*.yaml``) and composes into the new section."""
    from hydra.core.config_store import ConfigStore

    defaults = OmegaConf.to_container(OmegaConf.structured(JobConfig))
    store = ConfigStore.instance()
    store.store(name="nutp_defaults", node=defaults)
    for old, new in SECTION_ALIASES.items():  # the deprecated group of a defaults list
        for path in sorted((config_dir() / new).glob("*.yaml")):
            store.store(group=old, name=path.stem, node=OmegaConf.load(path), package=new)


def compose_config(config_name: str, overrides: list[str], directory: Path, *,
                   return_hydra_config: bool = False) -> Any:
    """Hydra's compose of ``directory/<config_name>.yaml`` (``hydra.runtime.choices`` under
    ``hydra`` with ``return_hydra_config``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    _register_defaults()
    with initialize_config_dir(config_dir=str(directory.resolve()), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides,
                       return_hydra_config=return_hydra_config)


def load_config(overrides: list[str] | None = None, *, config_name: str = "config",
                directory: Path | None = None) -> JobConfig:
    """Compose YAML + overrides, normalise (``normalise``) and validate into a ``JobConfig``.

    Raises ``ValueError`` naming the key for unknown keys, wrong types and bad values.
    """
    directory = directory or config_dir()
    overrides = rename_overrides(list(overrides or []))
    try:
        raw = compose_config(config_name, overrides, directory, return_hydra_config=True)
        OmegaConf.set_struct(raw, False)
        hydra = raw.pop("hydra")
        _rename_sections(raw, hydra.runtime.choices)
        base = OmegaConf.structured(JobConfig)
        writable_dir_check(base)
        merged = OmegaConf.merge(base, raw)
        data = OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ValueError(f"{key}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # hydra's own override/config errors
        if type(e).__module__.startswith("hydra"):
            raise ValueError(_hydra_message(str(e))) from None
        raise
    assert isinstance(data, dict)
    job: dict[str, Any] = {str(k): v for k, v in data.items()}
    normalise(job)
    return fit_cpu_cluster(_build(JobConfig, job))


def _hydra_message(text: str) -> str:
    """One line for a Hydra error. Hydra suggests ``+key=value`` for an unknown key, which the
    schema then rejects anyway: say the key is unknown and name the closest schema keys."""
    import difflib
    import re

    m = re.match(r"Could not override '([^']+)'", text)
    if m is None:
        return "config: " + " ".join(text.split())
    key = m.group(1)
    old = [o for o, n in SECTION_ALIASES.items() if n == key]
    if old and "No match in the defaults list" in text:  # a group choice, ``health=<option>``
        return (f"{key}: this config's defaults list picks no {key} group (one that picks the "
                f"deprecated /{old[0]}: <option> takes {key}=<option> once renamed /{key}: "
                "<option>)")
    if key in schema_keys():  # a primary config without the nutp_defaults default
        return (f"{key}: not in this config's composition (its defaults list must start with "
                "nutp_defaults, as configs/config.yaml and recipes/base_pretrain.yaml do)")
    close = difflib.get_close_matches(key, schema_keys(), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"{key}: unknown key (not in nemo_nutp/config/schema.py){hint}"


def schema_keys() -> list[str]:
    """Every dotted key of the schema (``train.steps``, ``recovery.fault.kind``, ...)."""
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out.append(f"{prefix}{k}")

    walk(OmegaConf.to_container(OmegaConf.structured(JobConfig)), "")
    return out


def validate_yaml_file(path: Path) -> JobConfig:
    """Load one YAML file (a full job or a recipe) strictly into ``JobConfig``."""
    return load_config([], config_name=path.stem, directory=path.parent)
