"""Simulator configuration: dataclasses are the schema, ``configs/sim/*.yaml`` overlay them.

``load_sim_config(overrides)`` composes ``configs/simulate.yaml`` (group ``sim`` = a scenario in
``configs/sim/``) with Hydra, merges the ``sim`` node onto ``OmegaConf.structured(SimConfig)``
(unknown keys and wrong types raise ``ValueError`` naming the full key) and validates values in
``__post_init__`` (``ValueError`` naming ``sim.<field>``). ``sim.cluster`` and ``sim.parallel``
are the job's own ``ClusterSpec`` and ``ParallelSpec`` (their checks' ``cluster.<k>`` is reworded
``sim.cluster.<k>``); the previous release's flat keys (``SIM_RENAMED``) are mapped with a
warning. The hardware file ``configs/sim/hardware/<sim.cluster.hardware>.yaml`` and the model
file ``configs/model/<sim.model>.yaml`` are loaded just as strictly.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from ..config.hardware import (
    DEFAULT_MFU,
    DEFAULT_TP_OVERLAP,
    HardwareSpec,
    _strict,
    load_yaml_strict,
)
from ..config.loading import compose_config
from ..config.schema import ModelConfig, config_dir
from ..layout.specs import ClusterSpec, ParallelSpec, bad_value, check_positive

POLICIES = ("drop", "drop-live", "drop+spares", "uniform-reduce", "nutp-restart", "nutp-live",
            "nutp-live+spares", "nutp+boost", "stop-wait")
"""Every timeline policy the simulator knows (``sim.policies`` picks and orders them)."""
CAPACITY_POLICIES = ("drop", "drop+spares", "uniform-reduce", "nutp", "nutp+spares", "nutp+boost")
"""Layouts the capacity model evaluates (the static sweep's rows: it has no transitions)."""
CAPACITY_OF = {"drop": "drop", "drop-live": "drop", "drop+spares": "drop+spares",
               "uniform-reduce": "uniform-reduce", "nutp-restart": "nutp", "nutp-live": "nutp",
               "nutp-live+spares": "nutp+spares", "nutp+boost": "nutp+boost"}
"""Timeline policy -> the layout it runs (``stop-wait`` runs the fault-free layout)."""
SPARE_LAYOUTS = ("drop+spares", "nutp+spares")
"""Layouts that hold ``sim.spare_domains`` spare scale-up domains on top of the job's GPUs: the
planner's healthiest-first slice order puts the worst slices out (``goodput/policies.py``)."""
MODE_OF = {"drop": "restart", "drop-live": "live", "drop+spares": "restart",
           "uniform-reduce": "restart", "nutp-restart": "restart", "nutp-live": "live",
           "nutp-live+spares": "live_spare", "nutp+boost": "live", "stop-wait": "stop-wait"}
"""How each timeline policy changes its layout (``goodput/transitions.py``): ``restart`` from
the newest checkpoint (the runtime today), ``live`` in-process re-layout, ``live_spare``: a
free spare slice's standby processes replace the failed one live (``live`` when none is free),
``stop-wait``: a restart that first waits for the failed GPUs (at most
``transitions.max_wait_hours``)."""
BLAST_KINDS = ("gpu", "node", "domain")
STRAGGLER_POLICIES = ("ignore", "rebalance", "exclude", "exclude-live", "drop")
"""``ignore``: equal shares, the job runs at its slowest replica; ``rebalance``: shares follow
speed (``nutp.rebalance``); ``exclude``: per stage, keep the straggler (rebalanced) or run the
stage at reduced TP without it, whichever is faster (the planner's choice), each exclusion and
return a planned restart (``exclude-live``: a planned live re-layout); ``drop``: replicas a
straggler slows leave (planned restarts)."""
LINK_POLICIES = ("ignore", "rebalance", "sync-relayout", "exclude", "restart")
"""Policies for a slow NIC (``goodput/links.py``): ``ignore`` and ``rebalance`` (micro-batch
re-split) keep the layout; ``sync-relayout`` moves the slow GPU's cross-replica units to its
TP peers (planned live re-layouts); ``exclude`` runs the replica without the GPU (planned live
re-layouts); ``restart`` checkpoint-restarts off the bad link (one planned restart)."""


def _frac(name: str, value: float, *, lo: float = 0.0, hi: float = 1.0) -> None:
    if not lo <= float(value) <= hi:
        raise bad_value(name, value, f"must be in [{lo}, {hi}]")


@dataclass(frozen=True)
class BlastConfig:
    """Blast radius mix: share of failures taking down one GPU, its node, or its domain."""

    gpu: float = 1.0
    """Share of failures confined to the failing GPU."""
    node: float = 0.0
    """Share taking down the whole host (sim.cluster.gpus_per_node GPUs)."""
    domain: float = 0.0
    """Share taking down the whole scale-up domain (NVSwitch tray, rack power, ...)."""

    def __post_init__(self) -> None:
        for k in BLAST_KINDS:
            _frac(f"sim.failures.blast.{k}", getattr(self, k))
        if abs(self.gpu + self.node + self.domain - 1.0) > 1e-6:
            raise bad_value("sim.failures.blast", (self.gpu, self.node, self.domain),
                            "gpu + node + domain shares must sum to 1")

    def shares(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in BLAST_KINDS}


@dataclass(frozen=True)
class FailureConfig:
    """The failure process (defaults: Llama 3 405B pre-training report)."""

    rate_per_gpu_day: float = 419 / (54 * 16384)
    """Unexpected interruptions per GPU-day: 419 in 54 days on 16,384 H100 (~4.7e-4)."""
    multiplier: float = 1.0
    """Scales the rate (e.g. 2.0 for a less mature fleet)."""
    hardware_fraction: float = 0.78
    """Share of failures that are hardware (GPU, HBM, NVLink, host...): 78% in Llama 3."""
    hardware_repair_hours: float = 120.0
    """Time a hardware failure keeps its GPUs out (multi-day RMA/repair)."""
    software_recovery_hours: float = 3.0
    """Time a software failure keeps its GPUs out (reboot, drain, health checks)."""
    repair_distribution: str = "fixed"
    """'fixed' durations or 'exponential' with those means."""
    blast: BlastConfig = field(default_factory=lambda: BlastConfig())
    """Share of failures taking down one GPU / its node / its whole scale-up domain."""
    trace: str | None = None
    """CSV/JSON failure trace (time_h, gpu, duration_h[, blast]); replaces the random process."""

    def __post_init__(self) -> None:
        _frac("sim.failures.hardware_fraction", self.hardware_fraction)
        for k in ("rate_per_gpu_day", "multiplier", "hardware_repair_hours",
                  "software_recovery_hours"):
            if not float(getattr(self, k)) >= 0:
                raise bad_value(f"sim.failures.{k}", getattr(self, k), "must be >= 0")
        if self.repair_distribution not in ("fixed", "exponential"):
            raise bad_value("sim.failures.repair_distribution", self.repair_distribution,
                            "must be 'fixed' or 'exponential'")

    @property
    def rate(self) -> float:
        """Failures per GPU-hour."""
        return self.rate_per_gpu_day * self.multiplier / 24.0


@dataclass(frozen=True)
class CostConfig:
    """Step-time model knobs (see ``goodput.cost``)."""

    mode: str = "full"
    """'full' (compute + TP comm + DP sync) or 'compute' (the planner's slowest-rank FLOPs only)."""
    shard_balance: str = "planner"
    """'planner': units split as the planner does (per unit space, independently);
    'balanced': FFN/vocab units fill in around the query-group remainder (a bound one unit off)."""
    mfu: float = DEFAULT_MFU
    """Fraction of peak FLOP/s the matmuls reach."""
    tp_overlap: float = DEFAULT_TP_OVERLAP
    """Fraction of TP communication hidden behind compute."""
    dp_overlap: float = 0.8
    """Fraction of the DP gradient sync hidden behind backward."""
    grad_bytes: int = 4
    """Bytes per gradient element in the DP sync (fp32 main grads)."""

    def __post_init__(self) -> None:
        if self.mode not in ("full", "compute"):
            raise bad_value("sim.cost.mode", self.mode, "must be 'full' or 'compute'")
        if self.shard_balance not in ("planner", "balanced"):
            raise bad_value("sim.cost.shard_balance", self.shard_balance,
                            "must be 'planner' or 'balanced'")
        _frac("sim.cost.mfu", self.mfu, lo=1e-3)
        _frac("sim.cost.tp_overlap", self.tp_overlap)
        _frac("sim.cost.dp_overlap", self.dp_overlap)
        check_positive("sim.cost.grad_bytes", self.grad_bytes)


@dataclass(frozen=True)
class BoostConfig:
    """Power boost of degraded replicas: speed-up (P/TDP)^alpha for P <= (1+max_power) TDP."""

    max_power: float = 0.30
    """Largest extra power over TDP a suitable rack sustains (the NTP paper's ~30%)."""
    alpha: float = 1.0 / 3.0
    """Exponent of the speed/power law: dynamic power ~ f*V^2 with V ~ f gives f ~ P^(1/3)."""

    def __post_init__(self) -> None:
        _frac("sim.boost.max_power", self.max_power, hi=4.0)
        _frac("sim.boost.alpha", self.alpha, lo=1e-3)


@dataclass(frozen=True)
class StragglerConfig:
    """Straggler process: GPUs running slow (thermal throttling, a bad link) for a while. A
    slow scale-out link has its own model and policies: ``LinkConfig`` (``sim.links``)."""

    rate_per_gpu_day: float = 0.0
    """Straggler episodes per GPU-day (0: none); a Poisson process next to the failures."""
    min_speed: float = 0.3
    """Slowest relative speed of a straggler (speeds are uniform in [min_speed, max_speed])."""
    max_speed: float = 0.9
    """Fastest relative speed of a straggler."""
    duration_hours: float = 12.0
    """Length of an episode (mean, if exponential)."""
    duration_distribution: str = "exponential"
    """'fixed' or 'exponential'."""
    policies: list[str] = field(default_factory=lambda: list(STRAGGLER_POLICIES))
    """Straggler policies compared side by side."""

    def __post_init__(self) -> None:
        if not float(self.rate_per_gpu_day) >= 0:
            raise bad_value("sim.stragglers.rate_per_gpu_day", self.rate_per_gpu_day,
                            "must be >= 0")
        if not 0.0 < self.min_speed <= self.max_speed <= 1.0:
            raise bad_value("sim.stragglers.min_speed", self.min_speed,
                            f"need 0 < min_speed <= max_speed={self.max_speed} <= 1")
        if not self.duration_hours > 0:
            raise bad_value("sim.stragglers.duration_hours", self.duration_hours, "must be > 0")
        if self.duration_distribution not in ("fixed", "exponential"):
            raise bad_value("sim.stragglers.duration_distribution", self.duration_distribution,
                            "must be 'fixed' or 'exponential'")
        for q in self.policies:
            if q not in STRAGGLER_POLICIES:
                raise bad_value("sim.stragglers.policies", q,
                                f"unknown; known: {STRAGGLER_POLICIES}")


@dataclass(frozen=True)
class LinkConfig:
    """Link fail-slow process: one GPU's scale-out NIC slowed for a while (``goodput/links.py``;
    calibration and sources in ``configs/sim/paper_32k.yaml``)."""

    rate_per_gpu_day: float = 0.0
    """Fail-slow episodes per GPU-day (0: none); a Poisson process next to the failures."""
    min_slowdown: float = 2.0
    """Smallest bandwidth divisor of the slow NIC (uniform in [min_slowdown, max_slowdown])."""
    max_slowdown: float = 10.0
    """Largest bandwidth divisor."""
    duration_hours: float = 0.4
    """Length of an episode (mean, if exponential)."""
    duration_distribution: str = "exponential"
    """'fixed' or 'exponential'."""
    detect_s: float = 30.0
    """Episode start -> slow link localised; every policy runs slow until then."""
    policies: list[str] = field(default_factory=lambda: list(LINK_POLICIES))
    """Link policies compared side by side."""

    def __post_init__(self) -> None:
        for k in ("rate_per_gpu_day", "detect_s"):
            if not float(getattr(self, k)) >= 0:
                raise bad_value(f"sim.links.{k}", getattr(self, k), "must be >= 0")
        if not 1.0 <= self.min_slowdown <= self.max_slowdown:
            raise bad_value("sim.links.min_slowdown", self.min_slowdown,
                            f"need 1 <= min_slowdown <= max_slowdown={self.max_slowdown}")
        if not self.duration_hours > 0:
            raise bad_value("sim.links.duration_hours", self.duration_hours, "must be > 0")
        if self.duration_distribution not in ("fixed", "exponential"):
            raise bad_value("sim.links.duration_distribution", self.duration_distribution,
                            "must be 'fixed' or 'exponential'")
        for q in self.policies:
            if q not in LINK_POLICIES:
                raise bad_value("sim.links.policies", q, f"unknown; known: {LINK_POLICIES}")


@dataclass(frozen=True)
class RestartPoint:
    """One published (job GPUs, seconds per checkpoint-restart) point of the restart model."""

    gpus: int = 1
    seconds: float = 0.0
    source: str = ""
    """Where the number comes from (paper, section)."""


def _plain_points() -> list[RestartPoint]:
    return [RestartPoint(4800, 150.0, "FlashRecovery, arXiv 2509.03047: 150 s end to end "
                                      "at 4,800 devices"),
            RestartPoint(100000, 600.0, "Meta FT-HSDP, arXiv 2602.00277: ~10 min stall per "
                                        "failure at O(100K) GPUs")]


@dataclass(frozen=True)
class TransitionConfig:
    """What a layout change costs (``goodput/transitions.py``); defaults and sources in
    ``configs/sim/paper_32k.yaml`` and docs/simulator.md."""

    detect_s: float = 30.0
    """Failure -> detected (unplanned events only)."""
    restart_points: list[RestartPoint] = field(default_factory=_plain_points)
    """Published plain checkpoint-restart times (detected -> training again, checkpoint load
    included); the model is the power law ``seconds = a * gpus ** k`` fitted to them in log
    space (one point: ``k = restart_exponent``)."""
    restart_exponent: float | None = None
    """Fixes ``k`` (None: fitted; needs >= 2 points)."""
    warm_standby_points: list[RestartPoint] = field(default_factory=lambda: [RestartPoint(
        1024, 20.0, "TrainMover, arXiv 2412.12636: ~20 s at 1,024 GPUs with warm standbys")])
    """Optional calibration of restarts onto warm standby machines (``calibration``)."""
    calibration: str = "plain"
    """'plain' (restart_points) or 'warm_standby' (warm_standby_points, the plain fit's k)."""
    checkpoint_interval_hours: float = 0.5
    """Checkpoint interval; an unplanned restart recomputes half of it on average (at most the
    time run since the previous transition, see ``recompute``). 0: no recomputation (needs
    save_s = 0)."""
    recompute: str = "capped"
    """What an unplanned restart recomputes: 'capped' (half an interval, at most the work run
    since the job last resumed) or 'half_interval' (always half an interval: the former
    ``sim.stop_wait`` formula; it can charge work the job never ran)."""
    save_s: float = 20.0
    """Training stall per checkpoint save, charged every interval to every timeline policy
    (all of them checkpoint)."""
    max_wait_hours: float | None = 0.25
    """stop-wait: longest wait for the failed GPUs (hot-swap from a spare pool); None: repair."""
    live_base_s: float = 1.0
    """Live re-layout fixed part: leave the collectives, abort and re-form communicators."""
    live_group_s: float = 0.2
    """Per process group rebuilt (a shrinking replica's TP groups, one per stage, and the
    cross-replica sync groups it belongs to: pp + tp_base)."""
    live_gbps: float | None = None
    """GB/s a rank receives the state of its new share at (None: the hardware's network_gbps:
    the lost piece comes from a peer replica)."""
    live_lost_steps: float = 1.0
    """Steps an unplanned live re-layout redoes: the in-flight step (at most)."""
    weight_bytes: int = 2
    """Bytes per weight moved in a live re-layout / read in a restart (bf16)."""
    optimizer_bytes: int = 12
    """Optimizer bytes per parameter (fp32 master + Adam moments; sharded over replicas)."""
    storage_gbps: float = 10000.0
    """Aggregate checkpoint read bandwidth, GB/s (measured mode: the scenario's load time)."""
    repair_batch_hours: list[float] = field(default_factory=lambda: [0.0, 24.0])
    """Take repaired GPUs back at once (0) or every N hours (one transition per batch). The
    first entry drives the timeline rows; every entry is compared in ``repair_batching``."""
    repair_batch_trials: int = 100
    """Trials the batching comparison runs on (the first ones of the timeline's draws)."""
    measured: str | None = None
    """``runs/bench/transitions.json`` of ``benchmarks/transition_cost.py``: replaces detect,
    restart and live times by measured ones, scaled to the scenario (``transitions.py``)."""

    def __post_init__(self) -> None:
        for k in ("detect_s", "checkpoint_interval_hours", "save_s", "live_base_s",
                  "live_group_s"):
            if not float(getattr(self, k)) >= 0:
                raise bad_value(f"sim.transitions.{k}", getattr(self, k), "must be >= 0")
        for k in ("weight_bytes", "optimizer_bytes", "live_lost_steps"):
            if not getattr(self, k) >= 0:
                raise bad_value(f"sim.transitions.{k}", getattr(self, k), "must be >= 0")
        if not self.storage_gbps > 0:
            raise bad_value("sim.transitions.storage_gbps", self.storage_gbps, "must be > 0")
        if self.live_gbps is not None and not self.live_gbps > 0:
            raise bad_value("sim.transitions.live_gbps", self.live_gbps, "must be > 0 or null")
        if self.max_wait_hours is not None and not self.max_wait_hours >= 0:
            raise bad_value("sim.transitions.max_wait_hours", self.max_wait_hours, "must be >= 0")
        if self.checkpoint_interval_hours == 0 and self.save_s > 0:
            raise bad_value("sim.transitions.save_s", self.save_s,
                            "must be 0 when sim.transitions.checkpoint_interval_hours is 0")
        if self.recompute not in ("capped", "half_interval"):
            raise bad_value("sim.transitions.recompute", self.recompute,
                            "must be 'capped' or 'half_interval'")
        if self.calibration not in ("plain", "warm_standby"):
            raise bad_value("sim.transitions.calibration", self.calibration,
                            "must be 'plain' or 'warm_standby'")
        for name in ("restart_points", "warm_standby_points"):
            for pt in getattr(self, name):
                if pt.gpus < 1 or not pt.seconds >= 0:
                    raise bad_value(f"sim.transitions.{name}", (pt.gpus, pt.seconds),
                                    "need gpus >= 1 and seconds >= 0")
        if not self.restart_points:
            raise bad_value("sim.transitions.restart_points", [], "needs at least one point")
        if self.restart_exponent is None and len({p.gpus for p in self.restart_points}) < 2:
            raise bad_value("sim.transitions.restart_exponent", None,
                            "needed when restart_points has fewer than two GPU counts")
        check_positive("sim.transitions.repair_batch_trials", self.repair_batch_trials)
        if not self.repair_batch_hours or any(not h >= 0 for h in self.repair_batch_hours):
            raise bad_value("sim.transitions.repair_batch_hours", self.repair_batch_hours,
                            "needs at least one entry, each >= 0")


def _sim_cluster() -> ClusterSpec:
    return ClusterSpec(num_gpus=32768, domain_size=32, gpus_per_node=4, hardware="b200_nvl32")


def _sim_parallel() -> ParallelSpec:
    return ParallelSpec(tp_base=32)


UNMODELLED = {"cluster": ("name",),
              "parallel": ("dp", "sequence_parallel", "unit_balance", "sync_layout",
                           "virtual_pipeline_model_parallel_size")}
"""Keys of the job's specs the simulator does not model: a value other than the default is an
error (never silently ignored)."""
SIM_RENAMED = {"num_gpus": "cluster.num_gpus", "domain_size": "cluster.domain_size",
               "gpus_per_node": "cluster.gpus_per_node", "hardware": "cluster.hardware",
               "tp_base": "parallel.tp_base", "pp": "parallel.pp", "min_tp": "parallel.min_tp"}
"""The previous release's flat ``sim.*`` keys -> the job's names (``sim.<new>``): mapped by
``load_sim_config`` with a FutureWarning; they go in the next release."""


@dataclass(frozen=True)
class SimConfig:
    """A simulator scenario: cluster, model, hardware, failure process, policies, sweeps."""

    name: str = "scenario"
    """Label used in tables and file names."""
    cluster: ClusterSpec = field(default_factory=_sim_cluster)
    """The job's ``cluster.*``: ``num_gpus`` in the job (spare domains of ``drop+spares`` and
    ``nutp-live+spares`` come on top), ``domain_size``, ``gpus_per_node`` (blast radius
    'node'), ``hardware`` (a file in configs/sim/hardware/, required here). ``name`` is not
    modelled (keep its default)."""
    model: str = "gpt_480b"
    """Name of a model file in configs/model/."""
    parallel: ParallelSpec = field(default_factory=_sim_parallel)
    """The job's ``parallel.*``: ``tp_base`` (healthy TP degree), ``pp`` (pipeline stages per
    replica), ``min_tp`` (smallest degree a stage may run at); the other keys are not modelled
    (keep their defaults: ``UNMODELLED``)."""
    micro_batches_per_replica: int = 16
    """Fault-free micro-batches per replica and step (sets how much DP sync is amortised)."""
    micro_batch_tokens: int = 8192
    """Tokens per micro-batch."""
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    """Policies compared side by side."""
    spare_domains: int = 2
    """Spare scale-up domains of ``drop+spares`` and ``nutp-live+spares``, on top of
    ``cluster.num_gpus``; each gives ``domain_size // tp_base`` spare TP slices (one whole
    domain per failed stage when ``tp_base == domain_size``)."""
    trials: int = 200
    """Monte Carlo trials per sweep point and for the timeline."""
    seed: int = 0
    """Seed of every random draw."""
    fractions: list[float] = field(default_factory=lambda: [1e-4, 5e-4, 1e-3, 2e-3, 4e-3])
    """Failed-GPU fractions of the static sweep (Fig. 6/7 analogues)."""
    blast_fraction: float = 2e-3
    """Failed-GPU fraction of the blast-radius sensitivity (Fig. 10 analogue)."""
    days: float = 15.0
    """Horizon of the timeline simulation."""
    step_hours: float = 1.0
    """Time step of the timeline."""
    steady_state: bool = True
    """Start the timeline with the failures of a long-running job (else all healthy at t=0)."""
    failures: FailureConfig = field(default_factory=FailureConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    boost: BoostConfig = field(default_factory=BoostConfig)
    transitions: TransitionConfig = field(default_factory=TransitionConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    links: LinkConfig = field(default_factory=LinkConfig)
    output_dir: str = "runs/sim"
    """Where JSON and PNGs go."""

    def __post_init__(self) -> None:
        for k in ("micro_batches_per_replica", "micro_batch_tokens", "trials"):
            check_positive(f"sim.{k}", getattr(self, k))
        for section, keys in UNMODELLED.items():
            spec = getattr(self, section)
            for fld in dataclasses.fields(spec):
                value = getattr(spec, fld.name)
                if fld.name in keys and value != fld.default:
                    raise bad_value(f"sim.{section}.{fld.name}", value, "not modelled by the "
                                    f"simulator: keep the default {fld.default!r}")
        if self.cluster.hardware is None:
            raise bad_value("sim.cluster.hardware", None, "the simulator needs a hardware file "
                            "(a name in configs/sim/hardware/)")
        if self.parallel.tp_base > self.cluster.domain_size:
            raise bad_value("sim.parallel.tp_base", self.parallel.tp_base,
                            f"exceeds sim.cluster.domain_size={self.cluster.domain_size}")
        if self.spare_domains < 0:
            raise bad_value("sim.spare_domains", self.spare_domains, "must be >= 0")
        for p in self.policies:
            if p not in POLICIES:
                raise bad_value("sim.policies", p, f"unknown policy; known: {POLICIES}")
        for f in self.fractions:
            _frac("sim.fractions", f, hi=0.5)
        _frac("sim.blast_fraction", self.blast_fraction, hi=0.5)
        if not (self.days > 0 and 0 < self.step_hours <= self.days * 24):
            raise bad_value("sim.step_hours", self.step_hours, "must be in (0, sim.days*24]")


def load_sim_config(overrides: list[str] | None = None, *, directory: Path | None = None
                    ) -> SimConfig:
    """Compose ``configs/simulate.yaml`` + Hydra overrides into a validated ``SimConfig``.

    The previous release's flat keys (``SIM_RENAMED``), on the command line or in a scenario
    file, are mapped to the job's names with one FutureWarning each; both names set differently in
    one place (the command line, or one file) is an error naming both. Across places Hydra's
    order holds: a derived scenario over its base, the command line over every file.
    """
    directory = directory or config_dir()
    overrides, on_cli = _renamed_overrides(list(overrides or []))
    try:
        raw = compose_config("simulate", overrides, directory, return_hydra_config=True)
    except Exception as e:
        if type(e).__module__.startswith(("hydra", "omegaconf")):
            raise ValueError(f"config: {str(e).splitlines()[0]}") from None
        raise
    OmegaConf.set_struct(raw, False)
    choice = OmegaConf.select(raw, "hydra.runtime.choices.sim")
    raw.pop("hydra", None)
    extra = [k for k in raw.keys() if k != "sim"]
    if extra:
        raise ValueError(f"{extra[0]}: unknown top-level key (only 'sim' is read)")
    sim = raw.get("sim") or OmegaConf.create({})
    _renamed_in_files(sim, _scenario_chain(directory, choice), on_cli)
    try:
        return _strict(SimConfig, sim, "sim")  # type: ignore[no-any-return]
    except ValueError as e:  # the job's specs name ``cluster.<k>``/``parallel.<k>``
        message = re.sub(r"(?<![\w.])(cluster|parallel)\.", r"sim.\1.", str(e))
        raise ValueError(message) from None


def _deprecated(old: str) -> None:
    warnings.warn(f"sim.{old} is deprecated: use sim.{SIM_RENAMED[old]} (the job's name); the "
                  "old name goes in the next release", FutureWarning, stacklevel=4)


def _both(old: str, value: Any, other: Any, where: str) -> ValueError:
    new = SIM_RENAMED[old]
    return bad_value(f"sim.{old}", value, f"deprecated name of sim.{new}, which {where} also "
                     f"sets ({other!r}): set sim.{new} only")


_OVERRIDE = re.compile(r"(\+\+|\+|~)?sim\.([\w.]+)(?:=(.*))?", re.S)


def _value(text: str | None) -> Any:
    """An override's value as YAML reads it (``1024`` -> 1024), for comparing and messages."""
    try:
        return yaml.safe_load(text) if text is not None else None
    except yaml.YAMLError:
        return text


def _renamed_overrides(overrides: list[str]) -> tuple[list[str], set[str]]:
    """Command-line overrides with the old keys renamed (one warning each), and the new names
    the command line sets."""
    given = {}
    for o in overrides:
        m = _OVERRIDE.fullmatch(o)
        if m and m.group(1) != "~" and m.group(2) in SIM_RENAMED.values():
            given[m.group(2)] = m.group(3)
    out, on_cli = [], set(given)
    for o in overrides:
        m = _OVERRIDE.fullmatch(o)
        if not m or m.group(2) not in SIM_RENAMED:
            out.append(o)
            continue
        sign, old, value = m.groups()
        new = SIM_RENAMED[old]
        if sign != "~" and new in given and _value(given[new]) != _value(value):
            raise _both(old, _value(value), _value(given[new]), "the command line")
        _deprecated(old)
        on_cli.add(new)
        # ``++``: the new key also lands in a scenario file that spells only the old names
        out.append(f"~sim.{new}" if sign == "~" else f"++sim.{new}={value}")
    return out, on_cli


def _scenario_chain(directory: Path, name: Any, depth: int = 0) -> list[tuple[str, dict]]:
    """(file name, own keys) of ``configs/sim/<name>.yaml`` and of the scenarios its defaults
    list names, in Hydra's merge order (a file after its defaults unless it lists ``_self_``
    first). Entries other than a plain scenario name are skipped."""
    if not isinstance(name, str) or depth > 16:
        return []
    path = directory / "sim" / f"{name}.yaml"
    if not path.is_file():
        return []
    node = OmegaConf.to_container(OmegaConf.load(path))
    if not isinstance(node, dict):
        return []
    own = {k: v for k, v in node.items() if k != "defaults"}
    entries = list(node.get("defaults") or [])
    out: list[tuple[str, dict]] = []
    for e in entries if "_self_" in entries else [*entries, "_self_"]:
        if e == "_self_":
            out.append((path.name, own))
        elif isinstance(e, str):
            out += _scenario_chain(directory, e, depth + 1)
    return out


def _renamed_in_files(sim: Any, chain: list[tuple[str, dict]], on_cli: set[str]) -> None:
    """Map the old keys the scenario files spell onto the new ones, in place: the last file
    setting either name wins, unless the command line sets the new one."""
    missing = object()
    for old, new in SIM_RENAMED.items():
        if old not in sim:
            continue
        value, last = sim.pop(old), "old"
        _deprecated(old)
        section, key = new.split(".")
        for fname, own in chain:
            a = own.get(old, missing)
            sec = own.get(section)
            b = sec.get(key, missing) if isinstance(sec, dict) else missing
            if a is not missing and b is not missing and a != b:
                raise _both(old, a, b, fname)
            last = "new" if b is not missing else "old" if a is not missing else last
        if new not in on_cli and last == "old":
            OmegaConf.update(sim, new, value, merge=True)


def load_model(cfg: SimConfig, directory: Path | None = None) -> ModelConfig:
    """The model named by ``sim.model`` (configs/model/<name>.yaml)."""
    path = (directory or config_dir()) / "model" / f"{cfg.model}.yaml"
    return load_yaml_strict(ModelConfig, path, "model")  # type: ignore[no-any-return]


def load_hardware(cfg: SimConfig, directory: Path | None = None) -> HardwareSpec:
    """The hardware named by ``sim.cluster.hardware`` (configs/sim/hardware/<name>.yaml)."""
    path = (directory or config_dir()) / "sim" / "hardware" / f"{cfg.cluster.hardware}.yaml"
    return load_yaml_strict(HardwareSpec, path, "hardware")  # type: ignore[no-any-return]
