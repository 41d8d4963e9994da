"""Plan <-> JSON. The schema is documented in docs/planning.md ("Plan JSON")."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .plan import Plan
from .units import SPACES


def plan_to_dict(plan: Plan, *, with_sync_groups: bool = True) -> dict[str, Any]:
    req = plan.request
    groups: dict[str, Any] = {
        "tp": plan.tp_groups(),
        "pp": plan.pp_groups(),
        "embedding": plan.embedding_groups(),
        "stage_dp": plan.stage_groups(),
    }
    if with_sync_groups:
        groups["sync"] = {
            f"stage{s}/{space}": {
                "shards": plan.sync[(s, space)].shards.tolist(),
                "owners": plan.sync_owner_ranks(s, space).tolist(),
            }
            for s in range(plan.pp) for space in SPACES
        }
    return {
        "schema": "nemo_nutp.plan/1",
        "policy": req.policy,
        "world_size": plan.world_size,
        "rank_to_gpu": list(plan.rank_to_gpu),
        "predicted_throughput": plan.predicted_throughput,
        "capacity": plan.capacity,
        "full_replicas": plan.full_replicas,
        "dropped_replicas": plan.dropped_replicas,
        "idle_healthy_gpus": plan.idle_healthy_gpus,
        "reshard_bytes_per_step": plan.reshard_bytes(),
        "unit_time_s": plan.unit_time_s,
        "replicas": [
            {"index": r.index, "tp": list(r.tp), "ranks": [list(x) for x in r.ranks],
             "gpus": [list(x) for x in r.gpus], "healthy": list(r.healthy), "speed": r.speed,
             "microbatches": r.microbatches, "weight": r.weight,
             "stage_times": list(r.stage_times)}
            for r in plan.replicas
        ],
        "groups": groups,
        "request": {
            "cluster": asdict(req.cluster), "model": asdict(req.model),
            "parallel": asdict(req.parallel),
            "health": {"failed_gpus": list(req.health.failed_gpus)},
            "replicas": None if req.replicas is None else [list(r) for r in req.replicas],
            "global_batch": req.global_batch, "policy": req.policy,
        },
    }


@contextlib.contextmanager
def atomic_path(path: str | Path, *, mode: int | None = None, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed over ``path`` (never a
    half-written file), on error removed. The file gets ``mode``, by default what a plain
    ``open`` would give (0666 minus the umask: 0644 usually), not ``mkstemp``'s 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _default_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_json_atomic(data: Any, path: str | Path) -> None:
    """Write JSON atomically (``atomic_path``)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1))
