"""Pure layout math: cluster/health specs, unit assignments, sync layouts, reshard plans, plans.

Nothing here imports ``torch`` or creates processes.
"""

from .cost import CostSpec, chunk_layers, stage_layers
from .plan import POLICIES, Plan, Replica, apportion, build_plan, fit_cluster
from .specs import (
    ClusterSpec,
    HealthReport,
    ModelDims,
    MoESpec,
    ParallelSpec,
    PlanRequest,
    interleave_error,
)
from .sync import ReshardPlan, SyncLayout, make_sync_layout, moved_lower_bound, reshard_plan
from .units import PARAM_KINDS, SPACES, assignment, global_index, local_layout, num_units

__all__ = [
    "PARAM_KINDS",
    "POLICIES",
    "SPACES",
    "ClusterSpec",
    "CostSpec",
    "HealthReport",
    "MoESpec",
    "ModelDims",
    "ParallelSpec",
    "Plan",
    "PlanRequest",
    "Replica",
    "ReshardPlan",
    "SyncLayout",
    "apportion",
    "assignment",
    "build_plan",
    "chunk_layers",
    "fit_cluster",
    "global_index",
    "interleave_error",
    "local_layout",
    "make_sync_layout",
    "moved_lower_bound",
    "num_units",
    "reshard_plan",
    "stage_layers",
]
