"""``nutp-bridge``'s configuration: a Megatron-Bridge recipe, its YAML/CLI overrides, NUTP's keys.

* The recipe is ``module:function`` (e.g.
  ``megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config``) returning Bridge's
  ``ConfigContainer``.
* One YAML file (``--config-file``) and ``a.b=c`` arguments override it with Bridge's own
  ``process_config_with_overrides`` (``megatron/bridge/training/utils/omegaconf_utils.py``).
* NUTP's settings use the names and validation of ``nutp-train`` (``nemo_nutp/config/schema.py``,
  composed by ``load_job``): the YAML's top-level ``nutp:``, ``health:``, ``cluster:``,
  ``output:`` and ``recovery:`` blocks and the arguments that start with ``nutp.``,
  ``health.``, ``cluster.``, ``output.``, ``recovery.`` (or select a group:
  ``cluster=node_pair``) are taken out before Bridge sees the rest (``failures``, ``health``'s
  deprecated name, too: ``load_job`` maps it, with its warning). A bad key or value is a
  ``ValueError`` naming it, raised before anything distributed exists. None of these is a
  top-level key of Bridge's ``ConfigContainer``; the schema sections that are (``model``,
  ``train``, ``checkpoint``) are Bridge's here, and ``bridge_keys`` maps them onto the schema.
  Under ``recovery.enabled=true`` Bridge's ``checkpoint.save`` / ``save_interval`` are the
  job's ``checkpoint.dir`` / ``checkpoint.interval`` (``recovery_keys``).

Importing this module imports neither Bridge nor megatron-core.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NUTP_SECTIONS = ("nutp", "health", "cluster", "output", "recovery")
"""Top-level keys that belong to NUTP (the schema of ``nutp-train``), not to Bridge."""

DEPRECATED_SECTIONS = ("failures",)
"""Deprecated names of NUTP sections (``failures`` -> ``health``), also NUTP's: ``load_job``
maps them with a warning (``config/loading.py: SECTION_ALIASES``)."""

def recipe_stand_ins(nutp: list[str]) -> list[str]:
    """What the recipe will set, standing in for NUTP's early checks: a checkpoint interval,
    and the distributed optimizer where a NUTP key needs it (``recovery.live_redundancy``);
    left off otherwise, as ``recovery.spares`` needs it off (the whole job is checked again
    once the recipe's values are known)."""
    keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[-1] for o in nutp}
    zero = keys.get("recovery.live_redundancy", "false").lower() == "true"
    return ["checkpoint.interval=1", f"train.distributed_optimizer={_value(zero)}"]


OUTPUT_DIR = "runs/bridge"
"""``output.dir`` of ``nutp-bridge`` unless set (``output.dir=`` or ``--output-dir``)."""


@dataclass
class BridgeJob:
    """A Bridge ``ConfigContainer`` and NUTP's validated settings (``JobConfig``)."""

    bridge: Any
    nutp: Any
    nutp_overrides: list[str]


def _value(v: Any) -> str:
    """A YAML value as a Hydra override value (lists, tuples and dicts as JSON flow, which Hydra
    parses)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return str(v)


def _flatten(prefix: str, node: Any) -> list[str]:
    if isinstance(node, dict):
        out: list[str] = []
        for k, v in node.items():
            out += _flatten(f"{prefix}.{k}", v)
        return out
    return [f"{prefix}={_value(node)}"]


def is_nutp_override(arg: str) -> bool:
    key = arg.split("=", 1)[0].lstrip("+~")
    return key.split(".", 1)[0] in (*NUTP_SECTIONS, *DEPRECATED_SECTIONS)


def split_yaml(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """(Bridge's part of the YAML file, NUTP's part as overrides). A top-level scalar of a NUTP
    section selects its config group (``cluster: node_pair``)."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config-file={path}: no such file")
    raw: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(raw, dict):
        raise ValueError(f"--config-file={path}: must be a mapping of config keys")
    nutp: list[str] = []
    for section in (*NUTP_SECTIONS, *DEPRECATED_SECTIONS):
        if section in raw:
            node = raw.pop(section)
            nutp += _flatten(section, node) if isinstance(node, dict) else [
                f"{section}={_value(node)}"]
    return raw, nutp


def load_recipe(spec: str) -> Any:
    """Call a recipe ``module:function`` (Bridge's import shim installed first)."""
    from ..compat.bridge_cpu import install_import_shim

    module, sep, func = spec.partition(":")
    if not sep or not module or not func:
        raise ValueError(f"--recipe={spec}: expected module:function, e.g. "
                         "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config")
    install_import_shim()
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--recipe={spec}: {e}") from None
    return fn()


def load_nutp(overrides: list[str], *, tp: int) -> Any:
    """NUTP's ``JobConfig`` exactly as ``nutp-train`` composes and validates it, with the healthy
    degree from Bridge's ``model.tensor_model_parallel_size``."""
    from ..config.recipes import load_job

    return load_job([f"parallel.tp_base={tp}", *overrides], mla=True)  # (bridge_run.mla_of)


def load_bridge_job(recipe: str, config_file: str | None, overrides: list[str], *,
                    output_dir: str | None = None) -> BridgeJob:
    """Recipe + YAML + CLI overrides -> (Bridge config, NUTP config). NUTP's keys are validated
    before the recipe is even called (a typo costs no Bridge import). ``output_dir``: the CLI's
    ``--output-dir``, another name for ``output.dir`` (both given, and different: an error)."""
    yaml_bridge, nutp = split_yaml(config_file) if config_file else ({}, [])
    nutp += [o for o in overrides if is_nutp_override(o)]
    if output_dir is not None:
        given = [o.split("=", 1)[1] for o in nutp if o.split("=", 1)[0].lstrip("+~") ==
                 "output.dir"]
        if any(g != output_dir for g in given):
            raise ValueError(f"--output-dir={output_dir}: output.dir={given[-1]} is also given "
                             "(the same setting: give one)")
        nutp.append(f"output.dir={_quoted(output_dir)}")
    rest = [o for o in overrides if not is_nutp_override(o)]
    # NUTP's keys and values alone: the recipe's keys (checkpoint interval, distributed
    # optimizer, pipeline_model_parallel_size for the replicas' per-stage degrees) are not
    # known yet, so their cross-checks pass here with stand-ins (the replicas are left out)
    # and run on the whole job below, as does the degree
    early = load_nutp([*recipe_stand_ins(nutp), *(o for o in nutp if not o.lstrip("+~")
                                                    .startswith("nutp.replicas="))], tp=1)
    check_nutp_unused(early.nutp, early.recovery)
    from ..compat.bridge_cpu import install_import_shim

    install_import_shim()
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    cfg = load_recipe(recipe)
    with tempfile.TemporaryDirectory(prefix="nutp_bridge_") as tmp:
        path = None
        if yaml_bridge:
            from omegaconf import OmegaConf

            path = str(Path(tmp) / "bridge_overrides.yaml")
            OmegaConf.save(OmegaConf.create(yaml_bridge), path)
        try:
            cfg = process_config_with_overrides(cfg, config_filepath=path, cli_overrides=rest)
        except Exception as e:  # omegaconf / hydra errors: one line
            raise ValueError(f"bridge override: {' '.join(str(e).split())}") from None
    resolve_mixed_precision(cfg)
    from .bridge_run import check_moe_recovery

    check_moe_recovery(cfg, early.recovery)
    job = load_nutp([*bridge_keys(cfg), *checkpoint_keys(cfg), f"output.dir={OUTPUT_DIR}",
                     *nutp, *recovery_keys(cfg, early.recovery)],
                    tp=int(cfg.model.tensor_model_parallel_size))
    return BridgeJob(bridge=cfg, nutp=job, nutp_overrides=nutp)


def _quoted(text: str) -> str:
    """A string as a quoted Hydra override value (any path)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def checkpoint_keys(cfg: Any) -> list[str]:
    """Bridge's checkpoint settings as the schema's (``checkpoint.*`` of ``nutp-train``), so
    that the NUTP job says what the run does: ``checkpoint.save`` -> ``checkpoint.dir``,
    ``checkpoint.save_interval`` -> ``checkpoint.interval`` (0 without ``save``; Bridge's
    ``None``, one save at the end, -> ``train.train_iters``), ``checkpoint.load`` ->
    ``checkpoint.load_dir``."""
    ck = cfg.checkpoint
    every = ck.save_interval
    interval = 0 if not ck.save or every == 0 else int(every or cfg.train.train_iters)
    out = [f"checkpoint.interval={interval}"]
    if ck.save:
        out.append(f"checkpoint.dir={_quoted(str(ck.save))}")
    if ck.load:
        out.append(f"checkpoint.load_dir={_quoted(str(ck.load))}")
    return out


RECOVERY_UNUSED = {"rate_per_gpu_day": "checkpoint.interval=auto of nutp-train (Bridge saves "
                                       "every checkpoint.save_interval steps)",
                   "probe_timeout_s": "launcher workers' device probe (nutp-bridge under "
                                      "torchrun has no recovery yet)"}
"""``recovery.*`` keys ``nutp-bridge`` does not read: refused by name when set."""


def check_nutp_unused(nutp: Any, recovery: Any) -> None:
    """``nutp.*`` keys of ``nutp-train``'s loop that ``nutp-bridge`` runs only in part:
    ``nutp.exclude_stragglers=true`` needs ``recovery.mode=live`` (the live re-layout excludes
    the straggler at a step boundary; the restart path's save-and-stop inside Bridge's
    ``train()`` is not built): one-line ``ValueError`` naming it otherwise. Rebalancing
    (``nutp.rebalance*``) and the straggler probe (``nutp.straggler_*``) run under Bridge's
    ``train()`` (``bridge_run.balance_callbacks``)."""
    if nutp.exclude_stragglers and not (recovery.enabled and recovery.mode == "live"):
        raise ValueError("nutp.exclude_stragglers=True: nutp-bridge excludes a straggler by a "
                         "live re-layout only (set recovery.enabled=true recovery.mode=live)")


def recovery_keys(cfg: Any, rec: Any) -> list[str]:
    """Under ``recovery.enabled=true``: where the supervisor finds the newest checkpoint (the
    job's ``checkpoint.dir``, ``checkpoint.interval``) is Bridge's ``checkpoint.save`` and
    ``save_interval``, the checkpoints Bridge's ``train()`` writes through NUTP's manager.
    ``recovery.mode=live`` needs them too: its fallback is the restart path. One-line
    ``ValueError`` naming the field: recovery without them, and a ``recovery.*`` key
    ``nutp-bridge`` does not read (``RECOVERY_UNUSED``)."""
    from ..config.schema import RecoveryConfig

    default = RecoveryConfig()
    for name, why in RECOVERY_UNUSED.items():
        if getattr(rec, name) != getattr(default, name):
            raise ValueError(f"recovery.{name}={getattr(rec, name)}: not read by nutp-bridge "
                             f"(it is for {why})")
    if not rec.enabled:
        return []
    ck = cfg.checkpoint
    if not ck.save or not ck.save_interval:
        field, value = ("checkpoint.save", ck.save) if not ck.save else (
            "checkpoint.save_interval", ck.save_interval)
        raise ValueError(f"{field}={value}: recovery.enabled=true restarts from the checkpoints "
                         "Bridge saves (set checkpoint.save and checkpoint.save_interval > 0)")
    return [f"checkpoint.dir={ck.save}", f"checkpoint.interval={int(ck.save_interval)}"]


def resolve_mixed_precision(cfg: Any) -> None:
    """``mixed_precision`` given by name (``"bf16_mixed"``, 53 of Bridge's recipes) or as an
    object, applied as Bridge's ``runtime_config_update`` applies it, with Bridge's own
    functions: the name resolved by ``get_mixed_precision_config`` (an unknown name is one
    line naming the field), ``finalize()``, then ``setup`` onto the model, optimizer and DDP
    configs. Bridge's own ``runtime_config_update`` cannot be called as it is: it also validates
    the container, whose TP-divisibility check a non-uniform layout fails
    (``bridge_run.validate_as_uniform`` runs that check at the rank)."""
    if cfg.mixed_precision is None:
        return
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config

    if isinstance(cfg.mixed_precision, str):
        try:
            cfg.mixed_precision = get_mixed_precision_config(cfg.mixed_precision)
        except ValueError as e:
            raise ValueError(f"mixed_precision={cfg.mixed_precision}: "
                             f"{' '.join(str(e).split())}") from None
    mp = cfg.mixed_precision
    if getattr(mp, "fp8", None) or getattr(mp, "fp4", None):
        return  # FP8/FP4: the field audit refuses mixed_precision.fp8 / .fp4 by name
        # (finalize() would first fail on Transformer Engine's absence, naming no field)
    cfg.mixed_precision.finalize()
    cfg.mixed_precision.setup(cfg.model, cfg.optimizer, cfg.ddp)


def check_precision(cfg: Any) -> None:
    """The optimizer's precision is the model's: ``mixed_precision=null`` leaves a bf16 recipe's
    ``optimizer.bf16=true``, which gives megatron's Float16 optimizer over fp32 parameters (it
    trains, but its state cannot be checkpointed)."""
    from .bridge_run import precision_of

    if cfg.mixed_precision is not None:  # Bridge sets model and optimizer from it
        return
    model = precision_of(cfg)
    for half in ("bf16", "fp16"):
        if getattr(cfg.optimizer, half, False) and model != half:
            raise ValueError(f"optimizer.{half}={getattr(cfg.optimizer, half)}: the model is "
                             f"{model} (set optimizer.{half}=false, or mixed_precision)")


def weight_decay_of(cfg: Any) -> float:
    """The weight decay the recipe starts with: megatron's ``OptimizerParamScheduler``
    overwrites ``optimizer.weight_decay`` at every step with its own schedule, from
    ``scheduler.start_weight_decay`` (the recipes' default: constant 0.033 while
    ``optimizer.weight_decay`` says 0.1). ``train.weight_decay`` of ``nutp-train`` is this value
    (its weight decay is constant)."""
    s = cfg.scheduler
    start = s.start_weight_decay
    return float(cfg.optimizer.weight_decay if start is None else start)


def _half(cfg: Any) -> bool:
    """Whether the model trains in bf16/fp16 (its own flags, or Bridge's ``mixed_precision``
    recipe, by name or object, which sets them)."""
    from .bridge_run import precision_of

    mp = cfg.mixed_precision
    if isinstance(mp, str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        mp = get_mixed_precision_config(mp)
    return precision_of(cfg) != "fp32" or bool(mp is not None and (
        getattr(mp, "bf16", False) or getattr(mp, "fp16", False)))


def tokenizer_vocabulary(cfg: Any) -> None:
    """``tokenizer.use_tokenizer_vocab_size`` (36 of Bridge's recipes), or no
    ``model.vocab_size``: the model's vocabulary is the tokenizer's, padded, as Bridge's
    ``setup()`` and provider make it (``_validate_and_set_vocab_size``, then
    ``calculate_padded_vocab_size`` by ``model.make_vocab_size_divisible_by`` x the healthy TP
    degree: the uniform run's size, which every NUTP replica trains in its uneven shards).
    ``model.vocab_size`` becomes that padded size; a tokenizer that cannot be built here is
    one line naming the field."""
    use = bool(getattr(cfg.tokenizer, "use_tokenizer_vocab_size", False))
    if not use and cfg.model.vocab_size is not None:
        return
    from megatron.bridge.training.setup import _validate_and_set_vocab_size
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    field = ("tokenizer.use_tokenizer_vocab_size=True" if use else "model.vocab_size=None")
    try:
        tokenizer = build_tokenizer(cfg.tokenizer)
    except Exception as e:  # an HF tokenizer off the network, a missing file: one line
        raise ValueError(f"{field}: the model's vocabulary is the tokenizer's, which could not "
                         f"be built here ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                         "; set model.vocab_size and tokenizer.use_tokenizer_vocab_size=false"
                         ) from None
    vocab, pad = _validate_and_set_vocab_size(
        model_vocab_size=cfg.model.vocab_size, tokenizer_vocab_size=tokenizer.vocab_size,
        use_tokenizer_vocab_size=use)
    m = cfg.model
    if pad:
        vocab = calculate_padded_vocab_size(vocab, m.make_vocab_size_divisible_by,
                                            m.tensor_model_parallel_size)
    m.vocab_size = int(vocab)
    cfg.tokenizer.use_tokenizer_vocab_size = False  # done: the model's size is set


def bridge_keys(cfg: Any) -> list[str]:
    """The recipe's model and batch as ``nutp-train`` overrides (``model.*``, ``train.*``;
    ``optimizer.``/``ddp.use_distributed_optimizer`` -> ``train.distributed_optimizer``), so
    the plan is made, and validated, by the same schema."""
    from dataclasses import asdict

    from .bridge_data import check_dataset
    from .bridge_fields import check_container, check_model
    from .bridge_run import check_moe, model_config_of, precision_of

    tokenizer_vocabulary(cfg)
    check_model(cfg.model)  # the model's refused fields first, all in one line: what the
    # recipe is (Qwen3-Next: its gated delta net, not its optimizer's weight decay of QK norms)
    check_container(cfg)
    check_precision(cfg)
    check_dataset(cfg)
    vocab = cfg.model.vocab_size
    model = model_config_of(cfg.model, vocab_size=int(vocab))
    check_moe(cfg)
    t = cfg.train
    zero = bool(cfg.optimizer.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer)
    if cfg.optimizer.use_precision_aware_optimizer and not zero:  # megatron's own rule
        raise ValueError("optimizer.use_precision_aware_optimizer=True: needs the distributed "
                         "optimizer (optimizer.use_distributed_optimizer=true)")
    if zero and precision_of(cfg) == "fp16":  # NUTP's ZeRO-1 (integrations/bridge_zero.py)
        raise ValueError("optimizer.use_distributed_optimizer=True: not with fp16 under NUTP "
                         "(its ZeRO-1 keeps no loss scaler): use bf16 or fp32, or "
                         "optimizer.use_distributed_optimizer=false")
    return [*(f"model.{k}={_value(v)}" for k, v in asdict(model).items()),
            f"train.global_batch_size={t.global_batch_size}",
            f"train.micro_batch_size={t.micro_batch_size}", f"train.steps={t.train_iters}",
            f"train.clip_grad={cfg.optimizer.clip_grad}", f"train.seed={cfg.rng.seed}",
            f"train.lr={cfg.optimizer.lr}", f"train.weight_decay={weight_decay_of(cfg)}",
            f"train.precision={precision_of(cfg)}", f"train.distributed_optimizer={_value(zero)}",
            # the gradient buffer's bytes in the planner's memory model (the NUTP DDP gets
            # Bridge's ddp config itself)
            f"train.grad_reduce_in_fp32={_value(bool(cfg.ddp.grad_reduce_in_fp32))}",
            f"parallel.pp={int(cfg.model.pipeline_model_parallel_size)}",
            "parallel.virtual_pipeline_model_parallel_size="
            f"{_value(cfg.model.virtual_pipeline_model_parallel_size)}",
            f"parallel.sequence_parallel={_value(bool(cfg.model.sequence_parallel))}"]
