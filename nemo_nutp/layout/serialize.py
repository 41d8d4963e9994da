"""Plan <-> JSON. The schema is documented in README.md ("Plan JSON")."""

from __future__ import annotations

import json
import os
import tempfile
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
        "replicas": [
            {"index": r.index, "tp": list(r.tp), "ranks": [list(x) for x in r.ranks],
             "gpus": [list(x) for x in r.gpus], "healthy": list(r.healthy), "speed": r.speed,
             "microbatches": r.microbatches, "weight": r.weight}
            for r in plan.replicas
        ],
        "groups": groups,
        "request": {
            "cluster": asdict(req.cluster), "model": asdict(req.model),
            "parallel": asdict(req.parallel),
            "health": {"failed_gpus": list(req.health.failed_gpus)},
            "replicas": None if req.replicas is None else list(req.replicas),
            "global_batch": req.global_batch, "policy": req.policy,
        },
    }


def write_json_atomic(data: Any, path: str | Path) -> None:
    """Write JSON to a temporary file in the same directory, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
