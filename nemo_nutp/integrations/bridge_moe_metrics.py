"""The MoE metrics Bridge logs (the load-balancing loss; ``training_log`` calls megatron's
``track_moe_metrics``), reduced NUTP's way.

megatron's tracker (``moe_logging.MoEMetricsTracker``) holds, on each rank, its own stage's
layers and its own tokens: per layer the sum over the rank's micro-batches of its routers'
values (a TP rank's part of its replica's sequence). Its stock ``_sync_metrics`` sums over
``pg_collection.pp``, then over the router's TP group, then averages over the data-parallel
group. Under NUTP neither group fits: with per-stage degrees a rank of a stage with fewer TP
ranks belongs to several of NUTP's pipeline groups while ``pgs.pp`` holds one, so the sums do
not pair up (the run hangs in the first step's ``training_log``), and an unweighted average over
replicas would not weight their uneven shares of the global batch.

``nutp_moe_tracker`` installs a tracker whose reduction is NUTP's: the sum over the stage group
(every replica's tokens of the stage's layers, every TP rank's part), then over the replica's
stages (each stage's TP rank 0), times ``micro-batches of this replica / global micro-batches``,
so that ``report``'s ``1 / get_num_microbatches()`` (the replica's count, ``bridge_run``)
leaves
the mean over the global batch's micro-batches: the value a one-process run logs. Every rank
then reports the same value."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch


@cache
def tracker_class() -> Any:
    """The tracker class (one class for the process)."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    class NUTPMoEMetricsTracker(MoEMetricsTracker):  # type: ignore[misc]
        """megatron's tracker with NUTP's reduction (module doc)."""

        def __init__(self, groups: Any, global_microbatches: int) -> None:
            super().__init__()
            self.groups, self.global_microbatches = groups, global_microbatches

        def _sync_metrics(self, metric_names: list[str], pg_collection: Any = None) -> None:
            for name in metric_names:
                if name in self._metrics:
                    entry = self._metrics[name]
                    entry.values.copy_(self.reduce(entry.values))

        def reduce(self, values: torch.Tensor) -> torch.Tensor:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            v = values.clone()
            torch.distributed.all_reduce(v, group=self.groups.stage)
            # (report multiplies by 1 / the replica's micro-batches, read there the same way)
            return self.across_stages(v) * (get_num_microbatches() / self.global_microbatches)

        def across_stages(self, v: torch.Tensor) -> torch.Tensor:
            """The stage's layers (equal on its ranks) summed with the replica's other
            stages'."""
            if self.groups.ctx.tp_rank != 0:
                v.zero_()
            torch.distributed.all_reduce(v, group=self.groups.replica)
            return v

    return NUTPMoEMetricsTracker


def nutp_moe_tracker(groups: Any, global_microbatches: int) -> None:
    """Make megatron's process-global MoE metrics tracker NUTP's, over ``groups`` (called as
    every world starts, and as ``bridge_live`` re-enters ``train()``: a live re-layout's new
    world reduces over its own groups). Its entries are carried over with their values zeroed:
    what the process recorded since the last report is no step of the new run. A world stopped
    by a failure had recorded its unfinished step's values for the micro-batches this rank ran
    (the TP1 replica's whole share, say), and that step is recomputed; a world that leaves
    ``train()`` at a step boundary (grow back, a straggler, new shares: ``on_train_step_end``)
    leaves before Bridge's ``training_log`` reports that step. Either way the next step's
    report would have added them."""
    from megatron.core.transformer.moe.moe_logging import (
        get_moe_metrics_tracker,
        set_moe_metrics_tracker,
    )

    old = get_moe_metrics_tracker()
    new = tracker_class()(groups, global_microbatches)
    new._metrics.update(old.metrics)
    new.clear()
    set_moe_metrics_tracker(new)
