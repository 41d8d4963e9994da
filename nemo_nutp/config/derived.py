"""Values derived from a job config: the planner's request and its cost and memory models, and
the CPU default cluster grown to fit explicit replicas. Pure functions of a ``JobConfig``."""

from __future__ import annotations

import dataclasses

from ..layout import ClusterSpec, PlanRequest
from ..layout.cost import CostSpec
from ..layout.memory import MemorySpec
from ..layout.plan import fit_cluster, slices_of, spare_slices
from ..layout.specs import MoESpec, normalize_replicas
from .hardware import cost_spec as hardware_cost_spec
from .hardware import hardware_spec
from .schema import CONFIG_DIR, CPU_CLUSTER, JobConfig, config_dir


def fit_cpu_cluster(cfg: JobConfig) -> JobConfig:
    """Explicit ``nutp.replicas`` on the CPU default cluster (its "GPUs" are local processes):
    the job with the cluster grown to fit them; any other job as it is."""
    p = cfg.parallel
    if cfg.nutp.replicas is None or cfg.cluster.name != CPU_CLUSTER:
        return cfg
    reps = normalize_replicas(cfg.nutp.replicas, p.pp)
    cluster = fit_cluster(cfg.cluster, p.tp_base, len(reps) * p.pp)
    return cfg if cluster == cfg.cluster else dataclasses.replace(cfg, cluster=cluster)


def cost_spec(cluster: ClusterSpec) -> CostSpec | None:
    """The stage cost model's constants for ``cluster.hardware`` (None: compute only), from the
    hardware files in ``configs/sim/hardware`` (``NUTP_CONFIG_DIR``'s first)."""
    dirs = [d / "sim" / "hardware" for d in dict.fromkeys((config_dir(), CONFIG_DIR))]
    return hardware_cost_spec(cluster.hardware, dirs)


def memory_spec(cfg: JobConfig) -> MemorySpec | None:
    """The planner's memory model inputs (``layout.memory``), or None when the cluster's
    hardware file gives no ``gpu_memory_gib`` (CPU runs)."""
    dirs = [d / "sim" / "hardware" for d in dict.fromkeys((config_dir(), CONFIG_DIR))]
    hw = hardware_spec(cfg.cluster.hardware, dirs)
    if hw is None or hw.gpu_memory_gib is None:
        return None
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if cfg.nutp.replicas is not None:
        replicas = len(cfg.nutp.replicas)
    else:
        replicas = p.dp or max(1, slices_of(cfg.cluster, p.tp_base) // p.pp)
    return MemorySpec(
        gpu_memory_gib=hw.gpu_memory_gib, param_bytes=4 if t.precision == "fp32" else 2,
        grad_bytes=4 if t.grad_reduce_in_fp32 or t.precision == "fp32" else 2,
        optimizer=t.optimizer,
        distributed_optimizer=t.distributed_optimizer, replicas=replicas,
        zero_redundancy=cfg.recovery.live_redundancy,
        micro_batch_size=t.micro_batch_size, sequence_parallel=p.sequence_parallel,
        flash_attention=m.core_attention != "megatron" or m.transformer_impl ==
        "transformer_engine", dropout=m.hidden_dropout > 0 or m.attention_dropout > 0,
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers or 1, vp=p.vp)


def plan_request(cfg: JobConfig, *, world_size: int | None = None,
                 moe: MoESpec | None = None) -> PlanRequest:
    """The planner's input for a job (``recovery.spares``: the last TP slices held back, until
    the job's health names what it holds back); ``moe``: the model's experts (``nutp-bridge``
    reads them from its provider, ``bridge_run.moe_spec_of``; the job config has none)."""
    health = cfg.health.as_report()
    if cfg.health.reserved_gpus is None and cfg.recovery.spares:
        held = [g for s in spare_slices(cfg.cluster, cfg.parallel.tp_base, cfg.recovery.spares)
                for g in s]
        health = dataclasses.replace(health, reserved_gpus=tuple(held))
    return PlanRequest(
        cluster=cfg.cluster, model=cfg.model, parallel=cfg.parallel,
        health=health, policy=cfg.nutp.policy,
        replicas=None if cfg.nutp.replicas is None else tuple(cfg.nutp.replicas),
        global_batch=cfg.train.num_microbatches, world_size=world_size,
        micro_batch_size=cfg.train.micro_batch_size, cost=cost_spec(cfg.cluster),
        memory=memory_spec(cfg), moe=moe,
    )
