"""The field audit (issue #32): every setting a Bridge text-LLM pretraining recipe can carry is in
``nemo_nutp/integrations/bridge_fields.py``'s table, and the table's classes hold.

The fields, enumerated from the installed Bridge (0.6.2) and megatron-core (0.19.2):
* ``model.*``: the fields of ``TransformerConfig``, ``MLATransformerConfig`` and every text-LLM
  recipe's provider class: ``type(cfg.model)`` of each pretraining recipe function in
  ``megatron.bridge.recipes`` (aliases counted once; VLM, audio and diffusion recipes left out by
  their module: ``_vl``, ``omni``, ``audio``, ``asr``, ``flux``, ``wan``, ``diffusion``) that
  builds offline; a recipe that needs an HF config (``AutoBridge.from_hf_pretrained`` or
  transformers' ``AutoConfig``, stubbed to fail at once: the hub is unreachable) is covered by the
  provider class of every registered text bridge (``PROVIDER_CLASS``, else ``GPTModelProvider``).
* every ``ConfigContainer`` section's dataclass (``dataset``: ``GPTDatasetConfig``), and the
  top-level fields that are optional or not a section (``peft``, ``mixed_precision``, ...).
Single process, no process group; Python 3.12 (``make test-bridge``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import math
import re
import sys
import typing
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

if importlib.util.find_spec("megatron.bridge") is None and sys.version_info < (3, 12):
    # the Python 3.11 env never has it; in the 3.12 env a missing install fails
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

from nemo_nutp.compat.bridge_cpu import install_import_shim
from nemo_nutp.integrations import bridge_fields as bf

ROOT = Path(__file__).resolve().parents[2]
MULTIMODAL = ("_vl", "omni", "audio", "asr", "flux", "wan", "diffusion")
"""Recipe and bridge modules that are not text LLMs (by module name)."""


class _NeedsHF(Exception):
    pass


def _no_hub(*args: Any, **kwargs: Any) -> Any:
    raise _NeedsHF()


@cache
def recipe_functions() -> tuple[Any, ...]:
    """The distinct text-LLM pretraining recipe functions of the installed Bridge."""
    install_import_shim()
    import megatron.bridge.recipes as recipes

    seen: dict[Any, str] = {}
    for name in sorted(dir(recipes)):
        fn = getattr(recipes, name)
        if inspect.isfunction(fn) and name.endswith("_config") and "pretrain" in name:
            seen.setdefault(fn, name)
    return tuple(fn for fn in seen if not any(m in fn.__module__ for m in MULTIMODAL))


@cache
def provider_classes() -> tuple[type, ...]:
    """``TransformerConfig``, ``MLATransformerConfig``, ``type(cfg.model)`` of every recipe that
    builds offline, and every registered text bridge's provider class."""
    install_import_shim()
    import transformers
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    classes: set[type] = {TransformerConfig, MLATransformerConfig}
    with mock.patch.object(AutoBridge, "from_hf_pretrained", _no_hub), \
            mock.patch.object(transformers.AutoConfig, "from_pretrained", _no_hub):
        for fn in recipe_functions():
            try:
                classes.add(type(fn().model))
            except _NeedsHF:
                pass

    def bridges(cls: type) -> typing.Iterator[type]:
        for sub in cls.__subclasses__():
            yield sub
            yield from bridges(sub)

    for bridge in bridges(MegatronModelBridge):
        if not any(m in bridge.__module__ for m in MULTIMODAL):
            classes.add(bridge.PROVIDER_CLASS or GPTModelProvider)  # type: ignore[attr-defined]
    return tuple(sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"))


def field_names(classes: typing.Iterable[type]) -> set[str]:
    """Every field the audit covers: ``model.*`` of ``classes`` and the container's."""
    from megatron.bridge.training.config import ConfigContainer

    names = {f"model.{f.name}" for c in classes for f in dataclasses.fields(c)}
    hints = typing.get_type_hints(ConfigContainer)
    for f in dataclasses.fields(ConfigContainer):
        if f.name == "model":
            continue
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if f.name == "dataset":
            sections = [a for a in sections if a.__name__ == "GPTDatasetConfig"]
        if not sections or type(None) in args or str in args:
            names.add(f.name)
        names |= {f"{f.name}.{x.name}" for s in sections for x in dataclasses.fields(s)}
    return names


def unclassified(names: set[str]) -> list[str]:
    return sorted(n for n in names if bf.classification(n) is None)


def table_names() -> list[str]:
    return [*bf.HONOURED, *bf.NOT_MATH, *bf.SUBSTITUTED, *bf.REFUSED]


def test_every_field_is_classified_once_and_every_entry_exists() -> None:
    names = field_names(provider_classes())
    missing = unclassified(names)
    assert not missing, f"{len(missing)} unclassified (add each to bridge_fields): {missing}"
    listed = table_names()
    twice = sorted({n for n in listed if listed.count(n) > 1})
    assert not twice, f"in more than one class: {twice}"
    stale = sorted(set(listed) - names)
    assert not stale, f"table entries no longer in Bridge/megatron-core: {stale}"
    for table in (bf.HONOURED, bf.SUBSTITUTED, bf.REFUSED, bf.ONLY_WITH):  # merges stay easy
        assert list(table) == sorted(table), [a for a, b in zip(table, sorted(table)) if a != b]
    dead = [p for p in bf.ONLY_WITH if not any(n.startswith(p) for n in bf.REFUSED)]
    # a switch is refused, or honoured (MoE: model.num_moe_experts)
    assert not dead and all(s in bf.REFUSED or s in bf.HONOURED
                            for s in bf.ONLY_WITH.values()), dead
    assert len(recipe_functions()) == 93  # Bridge 0.6.2's distinct text-LLM pretraining recipes


def test_a_planted_field_is_reported_unclassified() -> None:
    """A field a Bridge upgrade adds to a provider dataclass fails the audit, by name."""
    install_import_shim()
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    planted = dataclasses.make_dataclass(
        "PlantedProvider", [("nutp_planted_knob", float, dataclasses.field(default=1.0))],
        bases=(GPTModelProvider,))
    names = field_names([*provider_classes(), planted])
    assert unclassified(names) == ["model.nutp_planted_knob"]
    print(f"planted: {len(unclassified(names))} unclassified: {unclassified(names)}")


def test_every_honoured_field_names_a_test_that_exists() -> None:
    for name, node in bf.HONOURED.items():
        path, _, func = node.partition("::")
        file = ROOT / path
        assert file.is_file(), f"{name}: {path} does not exist"
        assert re.search(rf"^def {re.escape(func)}\(", file.read_text(), re.M), (
            f"{name}: no test {func} in {path}")


def _bad(accepted: Any) -> Any:
    """A value other than ``accepted`` (and not an equivalent off value)."""
    if accepted == bf.BRIDGE_DEFAULT:
        return lambda *args, **kwargs: None
    if isinstance(accepted, bool):
        return not accepted
    if accepted == bf.ABSENT or not accepted:
        return 7
    if isinstance(accepted, int | float) and not math.isinf(accepted):
        return accepted + 1
    if isinstance(accepted, float):  # inf
        return 1.0
    return "not-this"


@cache
def tiny_provider() -> Any:
    install_import_shim()
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    return GPTModelProvider(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                            num_attention_heads=4, seq_length=32, vocab_size=256)


def _switch(name: str) -> str | None:
    return next((s for p, s in bf.ONLY_WITH.items() if name.startswith(p) and name != s), None)


def test_the_tiny_provider_and_container_pass() -> None:
    from nemo_nutp.integrations.bridge_run import model_config_of

    assert model_config_of(tiny_provider(), vocab_size=256).num_layers == 2
    bf.check_container(tiny_container())


MODEL_REFUSED = sorted(n for n in bf.REFUSED if n.startswith("model."))


@pytest.mark.parametrize("name", MODEL_REFUSED)
def test_a_refused_model_field_is_one_line_naming_it(name: str) -> None:
    """``model_config_of``: the field away from the NUTP model's value (with its switch on, for a
    field read only with it) is a one-line ``ValueError`` naming it."""
    from nemo_nutp.integrations.bridge_run import model_config_of

    provider = copy.copy(tiny_provider())
    for field in filter(None, (_switch(name), name)):  # (an honoured switch: off is None)
        setattr(provider, field.split(".", 1)[1], _bad(bf.REFUSED.get(field)))
    with pytest.raises(ValueError) as e:
        model_config_of(provider, vocab_size=256)
    msg = str(e.value)
    assert f"{name}=" in msg and "not supported" in msg and "\n" not in msg, msg


@cache
def tiny_container() -> Any:
    install_import_shim()
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    cfg = vanilla_gpt_pretrain_config()
    cfg.optimizer.use_distributed_optimizer = False
    return cfg


def _with_section(cfg: Any, section: str) -> None:
    """Give ``cfg`` an object for an optional section (or a resolved mixed precision)."""
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config

    have = getattr(cfg, section)
    if section == "mixed_precision":
        setattr(cfg, section, get_mixed_precision_config(have or "bf16_mixed"))
    elif have is None:
        hint = typing.get_type_hints(ConfigContainer)[section]
        cls = next(a for a in typing.get_args(hint) if dataclasses.is_dataclass(a))
        needed = {"tp_comm_overlap": False} if section == "comm_overlap" else {}
        setattr(cfg, section, cls(**needed))


OTHER_REFUSED = sorted(n for n in bf.REFUSED if not n.startswith("model."))


@pytest.mark.parametrize("name", OTHER_REFUSED)
def test_a_refused_container_field_is_one_line_naming_it(name: str) -> None:
    cfg = copy.deepcopy(tiny_container())
    for field in filter(None, (_switch(name), name)):
        if "." in field:
            section, attr = field.split(".", 1)
            _with_section(cfg, section)
            setattr(getattr(cfg, section), attr, _bad(bf.REFUSED[field]))
        else:
            setattr(cfg, field, _bad(bf.REFUSED[field]))
    with pytest.raises(ValueError) as e:
        bf.check_container(cfg)
    msg = str(e.value)
    assert f"{name}=" in msg and "not supported" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("name", sorted(bf.SUBSTITUTED))
def test_an_active_substitution_is_noticed(name: str) -> None:
    cfg = copy.deepcopy(tiny_container())
    cfg.model = copy.copy(tiny_provider())
    section, attr = name.split(".", 1)
    _with_section(cfg, section)
    switch = _switch(name)  # a MoE kernel: noticed only with model.num_moe_experts on
    if switch is not None:
        setattr(cfg.model, switch.split(".", 1)[1], _bad(bf.REFUSED.get(switch)))
    setattr(getattr(cfg, section), attr, bf.SUBSTITUTED[name][0])
    assert not [n for n in bf.notices(cfg) if n.startswith(f"{name}=")]
    setattr(getattr(cfg, section), attr, _bad(bf.SUBSTITUTED[name][0]))
    assert [n for n in bf.notices(cfg) if n.startswith(f"{name}=")], name


def test_nutp_bridge_prints_each_notice_once(capfd: pytest.CaptureFixture[str]) -> None:
    """Transformer Engine layers in a recipe: one ``notice:`` line on stderr, printed by the
    launching process (rank 0), and the run is planned as before."""
    from nemo_nutp.launch.bridge_cli import print_notices

    cfg = copy.deepcopy(tiny_container())
    cfg.model.transformer_impl = "transformer_engine"
    print_notices(cfg)
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("notice:")]
    te = [ln for ln in err if "model.transformer_impl=transformer_engine" in ln]
    assert len(te) == 1 and "megatron's local layers" in te[0], err


def test_moe_kernels_of_a_dense_model_are_not_noticed() -> None:
    """A MoE substitution (``model.moe_token_dispatcher_type``, grouped GEMM, ...) is read only
    with ``model.num_moe_experts``: a dense model at megatron's defaults gets no notice."""
    cfg = copy.deepcopy(tiny_container())
    cfg.model = copy.copy(tiny_provider())
    cfg.model.moe_grouped_gemm = True
    assert cfg.model.moe_token_dispatcher_type != "alltoall"  # megatron's default: allgather
    assert not [n for n in bf.notices(cfg) if n.startswith(("model.moe_", "model.expert_"))]
    cfg.model.num_moe_experts = 8
    noticed = {n.split("=")[0] for n in bf.notices(cfg)}
    assert {"model.moe_grouped_gemm", "model.moe_token_dispatcher_type"} <= noticed, noticed


def test_no_final_evaluation_is_noticed() -> None:
    """``nutp-bridge`` runs Bridge's ``train()``, not ``pretrain()``: with evaluation on, one
    notice says the evaluations after training are not run; none without it."""
    cfg = copy.deepcopy(tiny_container())
    cfg.validation.eval_iters = 0
    assert not [n for n in bf.notices(cfg) if n.startswith("validation.eval_iters=")]
    cfg.validation.eval_iters = 2
    found = [n for n in bf.notices(cfg) if n.startswith("validation.eval_iters=2: ")]
    assert len(found) == 1 and "after training are not run" in found[0], found


@pytest.mark.parametrize("name", sorted(bf.WHY_REFUSED))
def test_bridge_resilience_switches_are_refused_naming_what_replaces_them(name: str) -> None:
    """Bridge's fault tolerance, in-process restart and straggler detection, switched on: one
    line naming the field and NUTP's replacement (``recovery.*``, or NUTP's straggler probe),
    whether the section is Bridge's dataclass or the plain dict that a ``+ft.x=...`` override
    or a YAML block makes of an unset section (Bridge's ``process_config_with_overrides``)."""
    section, attr = name.split(".", 1)
    replaced = "recovery." if section in ("ft", "inprocess_restart") else \
        "nutp.straggler_probe_interval"
    for as_dict in (False, True):
        cfg = copy.deepcopy(tiny_container())
        if as_dict:
            setattr(cfg, section, {attr: True})
        else:
            _with_section(cfg, section)
            setattr(getattr(cfg, section), attr, True)
        with pytest.raises(ValueError) as e:
            bf.check_container(cfg)
        msg = str(e.value)
        assert f"{name}=True: not supported" in msg and replaced in msg and "\n" not in msg, msg
        setattr(cfg, section, {attr: False} if as_dict else None)
        bf.check_container(cfg)  # off: passes


def test_an_unknown_key_of_a_section_given_as_a_dict_is_refused_by_name() -> None:
    """``+ft.enable_ft_pakage=true`` (a typo) makes ``ft`` the dict ``{enable_ft_pakage: True}``:
    refused by name, not ignored."""
    cfg = copy.deepcopy(tiny_container())
    cfg.ft = {"enable_ft_pakage": True}
    with pytest.raises(ValueError, match=r"^ft\.enable_ft_pakage: unknown key"):
        bf.check_container(cfg)
    cfg.ft = {"calc_ft_timeouts": True}  # a known field, not math (read only with the package)
    bf.check_container(cfg)
