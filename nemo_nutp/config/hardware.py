"""GPU hardware files (``configs/sim/hardware/*.yaml``) and strict YAML loading.

Shared by the planner's stage cost model (``config.derived.plan_request`` via ``cost_spec``) and
the goodput simulator (``goodput.config``); depends only on ``layout`` and OmegaConf, so neither
of those packages imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..layout.specs import CostSpec, bad_value

DEFAULT_MFU = 0.45
"""Fraction of peak FLOP/s the matmuls reach (planner and simulator default)."""
DEFAULT_TP_OVERLAP = 0.3
"""Fraction of TP communication hidden behind compute (planner and simulator default)."""


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU generation in one scale-up domain (numbers and sources in the YAML)."""

    name: str = "gpu"
    """Label shown in tables."""
    peak_tflops: float = 989.0
    """Dense BF16 tensor TFLOP/s per GPU."""
    nvlink_gbps: float = 450.0
    """Scale-up bandwidth per GPU per direction, GB/s."""
    network_gbps: float = 50.0
    """Scale-out (inter-domain) bandwidth per GPU per direction, GB/s."""
    tdp_w: float = 700.0
    """Thermal design power per GPU, W (the power a healthy replica runs at)."""
    usd_per_gpu_hour: float = 2.5
    """Price of one GPU-hour, USD."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU usable by a process, GiB (the planner's memory model,
    ``layout.memory``); None: memory unchecked."""

    def __post_init__(self) -> None:
        for k in ("peak_tflops", "nvlink_gbps", "network_gbps", "tdp_w", "usd_per_gpu_hour"):
            if not float(getattr(self, k)) > 0:
                raise bad_value(f"hardware.{k}", getattr(self, k), "must be > 0")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise bad_value("hardware.gpu_memory_gib", self.gpu_memory_gib, "must be > 0 (or null)")


def writable_dir_check(node: Any) -> None:
    """Frozen dataclasses make read-only nodes; clear the flag so YAML can overlay them."""
    OmegaConf.set_readonly(node, None)
    if OmegaConf.is_dict(node):
        for key in node.keys():
            child = node._get_node(key)
            OmegaConf.set_readonly(child, None)
            if OmegaConf.is_config(child):
                writable_dir_check(child)


def _strict(schema: type, raw: Any, prefix: str) -> Any:
    base = OmegaConf.structured(schema)
    writable_dir_check(base)
    try:
        return OmegaConf.to_object(OmegaConf.merge(base, raw))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        raise ValueError(f"{prefix}{'.' + key if key else ''}: {str(e).splitlines()[0]}") from None


def load_yaml_strict(schema: type, path: Path, prefix: str) -> Any:
    """Load one YAML file onto a dataclass schema (unknown keys -> ``ValueError`` naming them)."""
    if not path.exists():
        raise ValueError(f"{prefix}: file {path} not found")
    return _strict(schema, OmegaConf.load(path), prefix)


def hardware_spec(hardware: str | None, dirs: list[Path]) -> HardwareSpec | None:
    """The hardware file ``<hardware>.yaml`` (first of ``dirs`` holding it); None for None."""
    if hardware is None:
        return None
    found = [d / f"{hardware}.yaml" for d in dirs if (d / f"{hardware}.yaml").is_file()]
    if not found:
        known = sorted({q.stem for d in dirs for q in d.glob("*.yaml")})
        raise bad_value("cluster.hardware", hardware,
                        f"no such file in {dirs[0]} (known: {', '.join(known)})")
    return load_yaml_strict(HardwareSpec, found[0], "hardware")  # type: ignore[no-any-return]


def cost_spec(hardware: str | None, dirs: list[Path]) -> CostSpec | None:
    """The stage cost model's constants for a hardware file name (None: compute only): its
    FLOP/s and links with the default MFU and TP overlap. ``dirs``: where to look, in order."""
    hw = hardware_spec(hardware, dirs)
    if hw is None:
        return None
    return CostSpec.from_hardware(peak_tflops=hw.peak_tflops, nvlink_gbps=hw.nvlink_gbps,
                                  network_gbps=hw.network_gbps, mfu=DEFAULT_MFU,
                                  tp_overlap=DEFAULT_TP_OVERLAP, name=hw.name)
