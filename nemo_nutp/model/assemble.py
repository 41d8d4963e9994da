"""Assemble global tensors from the local shards of every rank (tests, export, checkpoints)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..layout import local_layout
from ..layout.specs import ModelDims
from ..layout.units import global_shape


def local_shards(model: torch.nn.Module) -> dict[str, tuple[str | None, Any, torch.Tensor]]:
    """name -> (kind, units, local tensor copy) for every parameter of this rank."""
    out = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        out[name] = (getattr(p, "nutp_kind", None), getattr(p, "nutp_units", None),
                     p.detach().clone())
    return out


def assemble(shards: list[dict[str, tuple[str | None, Any, torch.Tensor]]], dims: ModelDims
             ) -> dict[str, torch.Tensor]:
    """Global tensors from the shards of *one replica's* ranks (TP order).

    Every element must be written exactly once (sharded) or agree bitwise (replicated); a
    violation raises, so a wrong unit assignment cannot go unnoticed.
    """
    out: dict[str, torch.Tensor] = {}
    for name, (kind, _units, _t) in shards[0].items():
        if kind is None:
            first = shards[0][name][2]
            for s in shards[1:]:
                if not torch.equal(s[name][2], first):
                    raise AssertionError(f"{name}: replicated parameter differs across TP ranks")
            out[name] = first
            continue
        shape = global_shape(kind, dims)
        flat = torch.full((int(np.prod(shape)),), float("nan"))
        count = torch.zeros_like(flat)
        for s in shards:
            _, (lo, hi), t = s[name]
            idx = torch.from_numpy(local_layout(kind, dims, np.arange(lo, hi)))
            flat[idx] = t.reshape(-1)
            count[idx] += 1
        if not torch.all(count == 1):
            raise AssertionError(f"{name}: units not covered exactly once")
        out[name] = flat.view(shape)
    return out
