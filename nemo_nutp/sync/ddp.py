"""megatron-core DDP with NUTP cross-replica gradient sync.

MoE expert parameters (``model/moe.py``; ``num_experts`` given): megatron's expert bucket groups
become ``NUTPExpertBucketGroup`` (no collectives of their own) and ``sync/experts.py`` reduces
the experts after the dense engine; without ``num_experts`` expert parameters are refused.

``NUTPDistributedDataParallel`` *is* megatron-core's ``DistributedDataParallel``: its contiguous
grad buffers, ``main_grad`` accumulation, ``no_sync`` micro-batching, backward hooks and bucket
readiness tracking are unchanged. Only the communication of a bucket group is NUTP's: each
megatron bucket group is given the ``NUTPBucketGroup`` behaviour (a subclass of megatron's own
``_ParamAndGradBucketGroup``), whose ``start_grad_sync`` hands the bucket's parameters to the
rank's ``GradSyncEngine`` from the backward hooks, and whose ``finish_grad_sync`` completes it.
The bucket-group instances are built inside megatron's ``__init__`` (a nested function we cannot
override), hence the ``__class__`` swap right after construction.

Bucket size: ``ddp_config.bucket_size`` elements (default ``DEFAULT_BUCKET_SIZE``, fixed; not
megatron's default, which grows with the DP group — here the whole stage) sizes both megatron's
readiness buckets and the engine's per-group buckets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from ..layout import Plan
from ..parallel.groups import NUTPGroups
from .engine import DEFAULT_BUCKET_SIZE, GradSyncEngine
from .experts import ExpertSync


class NUTPBucketGroup(_ParamAndGradBucketGroup):
    """megatron bucket group whose collectives are NUTP's reshard + weighted reduction."""

    nutp_engine: GradSyncEngine

    def start_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        self.nutp_engine.mark_ready(self.params)

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        self.param_gather_dispatched = False
        if self.is_first_batch:  # megatron learns each param's hook count in the first batch
            silent = [p for p in self.params if p not in self.per_param_grad_ready_counts]
            if silent:
                names = [self.nutp_engine.name_of(p) for p in silent]
                raise RuntimeError(f"gradient sync: no backward hook fired for {names[:5]} "
                                   f"({len(names)} parameter(s)); every parameter must take "
                                   "part in the loss")
        if not self.ddp_config.overlap_grad_reduce or self.is_first_batch:
            self.start_grad_sync()
        self.nutp_engine.finish()

    def reset(self) -> None:
        super().reset()
        self.nutp_engine.reset()


class NUTPExpertBucketGroup(_ParamAndGradBucketGroup):
    """megatron's bucket group of MoE expert parameters: its collectives (over megatron's
    expert-data-parallel group) are replaced by ``ExpertSync``, which runs after the dense
    engine in ``finish_grad_sync``."""

    def start_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        return None

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        self.param_gather_dispatched = False


class NUTPDistributedDataParallel(DistributedDataParallel):
    """megatron-core DDP for one NUTP rank; pass the plan and this rank's groups."""

    def __init__(self, config: Any, ddp_config: DistributedDataParallelConfig,
                 module: Any, *, plan: Plan, groups: NUTPGroups,
                 num_experts: int | None = None, pg_collection: Any = None) -> None:
        if ddp_config.use_distributed_optimizer:
            raise ValueError("ddp.use_distributed_optimizer=True: megatron's distributed "
                             "optimizer buffers do not apply to NUTP; train.distributed_optimizer"
                             " builds NUTP's own (sync/zero.py) over the usual DDP")
        if ddp_config.num_distributed_optimizer_instances != 1:
            raise ValueError("ddp.num_distributed_optimizer_instances must be 1 with NUTP")
        if ddp_config.bucket_size is None:  # megatron's default grows with the DP group
            ddp_config = dataclasses.replace(ddp_config, bucket_size=DEFAULT_BUCKET_SIZE)
        elif ddp_config.bucket_size < 1:
            raise ValueError(f"sync.bucket_size={ddp_config.bucket_size}: must be >= 1")
        super().__init__(config, ddp_config, module, pg_collection=pg_collection or groups.pgs)
        self.nutp_experts: ExpertSync | None = None
        if self.expert_parallel_bucket_groups and num_experts is None:
            raise ValueError("expert parallel parameters are not supported with NUTP yet "
                             "(outside model/moe.py's MoE layers: pass num_experts)")
        if num_experts is not None:  # collective: every rank builds the expert groups
            self.nutp_experts = ExpertSync(plan, groups, list(module.named_parameters()),
                                           num_experts=num_experts)
            for bucket_group in self.expert_parallel_bucket_groups:
                bucket_group.__class__ = NUTPExpertBucketGroup
        if not ddp_config.overlap_grad_reduce:
            raise ValueError("ddp.overlap_grad_reduce must be True with NUTP (backward hooks "
                             "drive the canonical launch order)")
        dense = [(n, p) for n, p in module.named_parameters()
                 if getattr(p, "nutp_expert", None) is None]  # experts: ExpertSync's
        self.nutp_engine = GradSyncEngine(plan, groups, dense,
                                          bucket_size=ddp_config.bucket_size)
        for bucket_group in self.bucket_groups:
            bucket_group.__class__ = NUTPBucketGroup
            bucket_group.nutp_engine = self.nutp_engine
        # Communicators now, before the first step's heartbeat (issue #22 finding 7).
        self.nutp_engine.warm_up()

    def finish_grad_sync(self, *args: Any, **kwargs: Any) -> None:
        """megatron's per-bucket-group finish, then the whole step's sync, strictly: a
        parameter whose backward hook did not fire is an error naming it, never a silently
        skipped sync."""
        silent = [self.nutp_engine.name_of(p) for g in self.bucket_groups
                  if not g.is_first_batch for p in g.params
                  if g.per_param_grad_ready_counts.get(p, 0)
                  != g.golden_per_param_grad_ready_counts.get(p, 0)]
        if silent:
            raise RuntimeError(f"gradient sync: the backward hook of {silent[:5]} "
                               f"({len(silent)} parameter(s)) did not fire as in the first "
                               "step; every parameter must take part in the loss")
        super().finish_grad_sync(*args, **kwargs)
        self.nutp_engine.finish(strict=True)
        if self.nutp_experts is not None:
            self.nutp_experts.finish(self.nutp_engine)
