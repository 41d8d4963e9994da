"""A stage's parameters without building the model: megatron's order, the rank's real local
shapes, tagged as ``model.build`` tags them (``nutp_kind``, ``nutp_units``,
``sequence_parallel``), each with a ``main_grad``. On the ``meta`` device they cost no memory:
the pair-order replay (tests) and the one-rank-of-a-huge-job benchmark drive the real
``GradSyncEngine`` over them."""

from __future__ import annotations

import torch

from ..layout import Plan
from ..layout.cost import stage_layers
from .descriptors import rank_sync, stage_params


def stage_parameters(plan: Plan, rank: int, *, device: str | torch.device = "meta",
                     layers: int | None = None) -> list[tuple[str, torch.nn.Parameter]]:
    """``layers``: at most that many transformer layers (the sync's structure repeats per
    layer)."""
    rs = rank_sync(plan, rank)
    dims = plan.request.model
    lo, hi = stage_layers(dims.num_layers, plan.pp)[rs.stage]
    n = hi - lo if layers is None else min(layers, hi - lo)
    units = {k: v.units for k, v in rs.kinds.items()}
    sp = plan.request.parallel.sequence_parallel
    out = []
    for i, (kind, shape) in enumerate(stage_params(
            dims, rs.degree, units, layers=n, embedding=rs.stage == 0,
            output=rs.stage == plan.pp - 1)):
        p = torch.nn.Parameter(torch.empty(shape, device=device))
        p.main_grad = torch.zeros(shape, device=device)  # type: ignore[attr-defined]
        if kind is not None:
            p.nutp_kind = kind  # type: ignore[attr-defined]
            p.nutp_units = units[kind]  # type: ignore[attr-defined]
        elif sp:
            p.sequence_parallel = True  # type: ignore[attr-defined]
        out.append((f"p{i}.{kind}", p))
    return out
