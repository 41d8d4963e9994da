"""Pipeline parallelism under Bridge's ``train()``: the one substitution point for the stage
communicator, and the finalisation of a pipelined step.

Bridge 0.6.2 offers no extension point for the pipeline communicator: ``train()`` builds
megatron's stock ``P2PCommunicator(pp_group=pg_collection.pp, config=model_config)`` itself,
and ``evaluate()`` (called by ``train()`` without a communicator) builds its own. Both look the
class up as a global of their module. Under NUTP the stages of a replica run at their own TP
degrees, so activations move between ranks as ``pipeline.boundary`` maps them
(``NUTPP2PCommunicator``), never by megatron's one-peer-per-direction rule.

``stage_communicator(plan, groups)`` is that substitution, as a context manager around one
``train()`` call: inside it, the name ``P2PCommunicator`` in exactly the modules of
``SUBSTITUTED`` builds this rank's ``NUTPP2PCommunicator``; on exit the stock class is back.
``tests/integrations/test_bridge_pipeline.py`` fails when the pinned Bridge no longer builds
the communicator where ``SUBSTITUTED`` says (the substitution would then silently do nothing).

``PipelineFinish`` is megatron's ``finalize_model_grads_func`` slot for ``pp > 1``: the NUTP
cross-replica sync of each stage, then ``PipelineFinalizer`` (tied embeddings combined by vocab
unit between the first and last stage, the whole model's grad norm), so that the exact norm the
optimizer clips with (``bridge.exact_grad_norm``) covers every stage.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

SUBSTITUTED: dict[str, str] = {
    "megatron.bridge.training.train":
        "p2p_communicator = P2PCommunicator(pp_group=pg_collection.pp, config=model_config)",
    "megatron.bridge.training.eval":
        "eval_p2p_communicator = P2PCommunicator(pp_group=pg_collection.pp, config=model_config)",
}
"""Module -> the line of its source that builds the stock communicator (the test pins it)."""


@contextmanager
def stage_communicator(plan: Any, groups: Any) -> Iterator[None]:
    """Inside: Bridge's ``train()`` and ``evaluate()`` build this rank's NUTP stage
    communicator. Nothing is replaced when ``plan.pp == 1`` (no communication between
    stages)."""
    if plan.pp == 1:
        yield
        return
    from ..pipeline.p2p import NUTPP2PCommunicator

    rank = groups.ctx.rank
    built: list[NUTPP2PCommunicator] = []

    def factory(pp_group: Any, config: Any) -> NUTPP2PCommunicator:
        comm = NUTPP2PCommunicator(pp_group, config, plan=plan, rank=rank,
                                   comm=getattr(groups, "comm", None))
        if not built:
            comm.warm_up()  # every pair's communicator before the first step (NCCL)
        built.append(comm)
        return comm

    modules = [importlib.import_module(name) for name in SUBSTITUTED]
    stock = [getattr(m, "P2PCommunicator") for m in modules]  # noqa: B009
    for m in modules:
        setattr(m, "P2PCommunicator", factory)  # noqa: B010
    try:
        yield
    finally:
        for m, cls in zip(modules, stock, strict=True):
            setattr(m, "P2PCommunicator", cls)  # noqa: B010


class PipelineFinish:
    """megatron's ``finalize_model_grads_func`` for a NUTP model: each chunk's cross-replica
    sync finished; MoE's aux-loss-free expert bias updated from the global batch's token counts
    (``model.moe.update_expert_bias``, once per step, as megatron's ``finalize_model_grads``);
    with ``pp > 1`` then the pipelined step's finalisation (tied embeddings,
    the whole model's grad norm on every rank)."""

    def __init__(self, plan: Any, groups: Any, model: Any) -> None:
        self.finalizer = None
        if plan.pp > 1:
            from ..pipeline.finalize import PipelineFinalizer

            self.finalizer = PipelineFinalizer(plan, groups, model)
            self.finalizer.warm_up()

    def __call__(self, model_chunks: list[Any], num_tokens: Any = None, **kwargs: Any) -> None:
        for chunk in model_chunks:
            chunk.finish_grad_sync()
        for chunk in model_chunks:  # as megatron's finalize_model_grads: after the grad sync
            if getattr(chunk.config, "moe_router_enable_expert_bias", False):
                from ..model.moe import update_expert_bias  # megatron-core 0.19 (MoE)

                update_expert_bias(chunk)
        if self.finalizer is not None:
            self.finalizer.finish(0.0)  # the loss is shared by the recording (bridge_run)


def chunk_views(ddp: Any) -> list[Any]:
    """Bridge's list of model chunks for virtual pipeline stages: one ``ChunkView`` per chunk
    of the one NUTP DDP (``bridge.nutp_ddp``). Bridge's ``train()`` and megatron's interleaved
    schedule call each entry's forward and its DDP methods; the grad buffer, its zeroing and
    the sync are the DDP's, done once (by the first view)."""
    return [ChunkView(ddp, i) for i in range(len(ddp.module.chunks))]


class ChunkView(torch.nn.Module):
    """Virtual stage ``index`` of the NUTP DDP ``ddp`` as Bridge sees a model chunk."""

    nutp_ddp: Any

    def __init__(self, ddp: Any, index: int) -> None:
        super().__init__()
        self.module = ddp.module.chunks[index]
        self.__dict__["nutp_ddp"] = ddp  # not a submodule: its parameters are the chunks'
        self.index = index
        self.config = ddp.config
        self.ddp_config = ddp.ddp_config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _first(self, name: str) -> Any:
        return getattr(self.nutp_ddp, name)() if self.index == 0 else None

    def zero_grad_buffer(self) -> None:
        self._first("zero_grad_buffer")

    def start_grad_sync(self) -> None:
        self._first("start_grad_sync")

    def finish_grad_sync(self) -> None:
        self._first("finish_grad_sync")

    def no_sync(self) -> Any:
        return self.nutp_ddp.no_sync()
