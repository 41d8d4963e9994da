"""Several ``nutp-bridge`` runs in one spawned world (a run and its negative control): each rank
imports Bridge once (about 7 CPU-s a rank) instead of once per world.

Each run is a rank worker of its own (``worker(rank, world, port, *args, outdir)``, e.g.
``bridge_moe_jobs.nutp_worker``), called in turn on every rank with a port of its own: the
worker's ``gloo_rank`` starts and ends its process group as in a world of its own. What the
workers and their controls patch (``PATCHED``: routing and MTP recorders, the controls' stand-ins)
is put back after each run, so a run sees the modules as a fresh world would.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

PATCHED = (
    ("megatron.core.transformer.moe.router", "TopKRouter", "forward"),
    ("megatron.core.transformer.multi_token_prediction", "MTPLossLoggingHelper",
     "track_mtp_metrics"),
    ("megatron.core.transformer.moe.moe_logging", "MoEMetricsTracker", "_aggregate"),
    ("nemo_nutp.integrations.bridge_run", None, "moe_of"),
    ("nemo_nutp.integrations.bridge_run", None, "mtp_log_callbacks"),
    ("nemo_nutp.model.moe", None, "build_moe_gpt_model"),
    ("nemo_nutp.model.moe", None, "update_expert_bias"),
    ("nemo_nutp.sync.experts", "ExpertSync", "finish"),
)
"""(module, class or None, attribute): what the Bridge MoE workers and their controls replace."""


def _snapshot() -> list[tuple[Any, str, Any]]:
    saved = []
    for module, cls, name in PATCHED:
        owner: Any = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
        saved.append((owner, name, vars(owner)[name]))  # the descriptor (staticmethod) as is
    return saved


def runs_worker(rank: int, world: int, port: int,
                runs: list[tuple[Callable[..., None], int, tuple[Any, ...]]],
                outdir: str) -> None:
    """``worker(rank, world, run_port, *args, outdir)`` for each ``(worker, run_port, args)``
    of ``runs`` in turn, ``PATCHED`` restored after each (``port``: unused, each run has its
    own). First what a run's ``gloo_rank`` and ``load`` do first: the CPU patches, the
    Hugging Face hub offline (before ``PATCHED``'s modules are imported)."""
    from nemo_nutp.compat.cpu import apply_cpu_patches

    from .hf_offline import offline_hf

    apply_cpu_patches()
    offline_hf()
    for worker, run_port, args in runs:
        saved = _snapshot()
        try:
            worker(rank, world, run_port, *args, outdir)
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)


def spawn_runs(world: int, runs: list[tuple[Callable[..., None], tuple[Any, ...]]],
               outdir: Path) -> None:
    """One world of ``world`` ranks running ``runs`` (``(worker, args)``, as
    ``spawn(worker, world, args, outdir)`` would) in turn, its ranks started with Bridge
    imported (``bridge_fork``)."""
    from .bridge_fork import spawn_bridge
    from .dist import free_port

    spawn_bridge(runs_worker, world, ([(w, free_port(), a) for w, a in runs],), outdir)
