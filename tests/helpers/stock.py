"""Harness for issue 12: NUTP checkpoints <-> *stock* megatron-core ``GPTModel`` (local spec).

Worlds (spawned by ``test_megatron_format``), every check computed here, nothing hard-coded:

* ``nutp_save`` (NUTP layouts): train ``SAVE_AT`` steps, save, record the global logits of a
  fixed batch (vocab shards gathered over the TP group).
* ``stock_world`` (stock megatron at TP1 or TP2, megatron's ``parallel_state``): load every NUTP
  checkpoint with plain ``dist_checkpointing.load(model.sharded_state_dict(), dir)`` and record
  logits; TP1 also records the checkpoints' DCP metadata (keys, global shapes, dtypes) next to
  its own; then train from the global init (TP1: ``init_global``; TP2: megatron's own resharding
  of the TP1 step-0 checkpoint), save like Megatron-LM (``iter_N`` + tracker, megatron's
  optimizer state), continue ``AFTER`` steps (full reference), and train ``AFTER`` steps from the
  saved weights with a fresh optimizer (weights-only reference).
* ``nutp_resume`` (NUTP layout): load each stock root (and NUTP roots saved asynchronously in
  another layout), full and weights-only, train ``AFTER``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

SAVE_AT, AFTER, SEED, LR, GLOBAL_BATCH, MBS = 3, 2, 1234, 1e-3, 8, 2
# vocab divisible by 2: stock TP2 needs it; QK norm: its per-head norms' keys go both ways too
MODEL = dict(add_bias_linear=True, vocab_size=104, qk_layernorm=True)
ASYNC = ("tp3_tp2_tp2",)
"""NUTP layouts whose checkpoint is saved asynchronously (``checkpoint.async_save``)."""


def dims() -> Any:
    from nemo_nutp.config import ModelConfig

    return ModelConfig(**MODEL)


def batches(step: int, count: int = GLOBAL_BATCH) -> list[Any]:
    from nemo_nutp.data import replica_microbatches

    d = dims()
    return replica_microbatches(offset=0, count=count, seed=SEED, step=step,
                                micro_batch_size=MBS, seq_length=d.seq_length,
                                vocab_size=d.vocab_size)


def probe() -> Any:
    """The fixed batch whose logits are compared (not a training batch)."""
    return batches(step=99, count=1)[0]


def mask() -> torch.Tensor:
    s = dims().seq_length
    return torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]


# ---------------------------------------------------------------- NUTP side

def nutp_session(replicas: tuple[int, ...]) -> Any:
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan
    from nemo_nutp.train.session import build_session

    tb = max(replicas)
    plan = build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=tb * len(replicas), domain_size=tb, gpus_per_node=tb),
        model=dims(), parallel=ParallelSpec(tp_base=tb), replicas=replicas,
        global_batch=GLOBAL_BATCH))
    return build_session(plan, plan.request.model, lr=LR, seed=SEED, micro_batch_size=MBS)


def nutp_logits(s: Any) -> torch.Tensor | None:
    """Global logits of the probe batch (replica 0's TP group gathers; rank 0 returns them)."""
    import torch.distributed as dist

    mb = probe()
    with torch.no_grad():
        local = s.gpt(mb.tokens, mb.position_ids, s.mask).float()
    parts: list[Any] = [None] * s.groups.pgs.tp.size()
    dist.all_gather_object(parts, (s.gpt.vocab_start, local), group=s.groups.pgs.tp)
    if dist.get_rank() != 0:
        return None
    return torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])], dim=-1)


def nutp_save(layouts: dict[str, tuple[int, ...]], out: str) -> None:
    import torch.distributed as dist

    from .roundtrip import save

    for name, replicas in layouts.items():
        s = nutp_session(replicas)
        losses = [s.step(k).loss for k in range(SAVE_AT)]
        logits = nutp_logits(s)  # of the saved state
        # ASYNC layouts save in the background while a step changes every parameter.
        checks = save(s, os.path.join(out, f"nutp_{name}"), SAVE_AT, background=name in ASYNC,
                      during=lambda s=s: s.step(SAVE_AT))
        if dist.get_rank() == 0:
            torch.save({"losses": losses, "logits": logits, **checks},
                       os.path.join(out, f"nutp_{name}.pt"))
        dist.barrier()


def nutp_resume(replicas: tuple[int, ...], roots: list[str], out: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.checkpoint import load_newest_valid
    from nemo_nutp.checkpoint.megatron_format import sources

    res: dict[str, Any] = {}
    for root in roots:
        for full in (True, False):
            s = nutp_session(replicas)  # fresh weights: everything comes from the checkpoint
            info = load_newest_valid(s, sources(Path(out) / root), load_optimizer=full)
            assert info is not None, root
            assert (info["marker"] is None) == root.startswith("stock_"), info
            start = info["step"]
            res[f"{root}/{'full' if full else 'weights'}"] = {
                "start": start, "optimizer": info["optimizer"],
                "losses": [s.step(k).loss for k in range(start, start + AFTER)]}
    if dist.get_rank() == 0:
        torch.save(res, os.path.join(out, "nutp_resume.pt"))
    dist.barrier()


# ---------------------------------------------------------------- stock side

def stock_build(*, init: bool) -> tuple[Any, Any, Any]:
    """Stock GPTModel (megatron's local spec), its DDP and optimizer at megatron's global TP."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from nemo_nutp.model.build import param_kind
    from nemo_nutp.model.init import init_global
    from tests.helpers.reference import _config

    d = dims()
    config = _config(SimpleNamespace(precision="fp32"), d)
    from megatron.core import parallel_state

    config.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=d.normalization,
                                                      qk_layernorm=d.qk_layernorm),
                     vocab_size=d.vocab_size, max_sequence_length=d.seq_length,
                     position_embedding_type=d.position_embedding_type,
                     share_embeddings_and_output_weights=d.tie_embeddings, parallel_output=True)
    if init:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init_global(name, param_kind(name), d, seed=SEED, std=d.init_std,
                                    shape=tuple(p.shape)))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=0.0, weight_decay=0.0, adam_eps=1e-8,
        params_dtype=torch.float32, use_distributed_optimizer=False), [ddp])
    return model, ddp, opt


def stock_step(ddp: Any, opt: Any, step: int) -> float:
    """One step on the whole global batch (as ``tests/helpers/reference.run_reference``)."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    mbs = batches(step)
    total = 0.0
    for i, mb in enumerate(mbs):
        if i < len(mbs) - 1:
            with ddp.no_sync():
                loss = ddp(mb.tokens, mb.position_ids, mask(), labels=mb.labels).float().mean()
                (loss / len(mbs)).backward()
        else:
            loss = ddp(mb.tokens, mb.position_ids, mask(), labels=mb.labels).float().mean()
            (loss / len(mbs)).backward()
        total += float(loss.detach())
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    return total / len(mbs)


def stock_load(ddp: Any, path: Path, opt: Any = None) -> Any:
    """Megatron-LM's load: plain ``dist_checkpointing.load`` of the model's (and optimizer's)
    own sharded state dict, no adapter."""
    from megatron.core import dist_checkpointing

    sd: dict[str, Any] = {"model": ddp.module.sharded_state_dict()}
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=True)
    loaded = dist_checkpointing.load(sd, str(path))
    ddp.module.load_state_dict(loaded["model"])
    if opt is not None:
        opt.load_state_dict(loaded["optimizer"])
    return loaded


def stock_save(ddp: Any, opt: Any, root: Path, iteration: int) -> Path:
    """Megatron-LM's save layout: ``iter_N/`` (model, optimizer, iteration) + the tracker."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    d = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        d.mkdir(parents=True)
    dist.barrier()
    sd: dict[str, Any] = {"model": ddp.module.sharded_state_dict(), "iteration": iteration,
                          "checkpoint_version": 3.0}
    sd["optimizer"] = opt.sharded_state_dict(sd)
    dist_checkpointing.save(sd, str(d))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    dist.barrier()
    return d


def stock_logits(model: Any) -> torch.Tensor:
    mb = probe()
    with torch.no_grad():
        return model(mb.tokens, mb.position_ids, mask(), runtime_gather_output=True).float()


def dcp_metadata(path: Path) -> dict[str, Any]:
    """{key: (global shape, dtype)} of tensors and {key: 'object'} of objects in a checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), str(v.properties.dtype))
            if isinstance(v, TensorStorageMetadata) else "object" for k, v in meta.items()}


def stock_world(tp: int, nutp: list[str], out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    rank0 = dist.get_rank() == 0
    res: dict[str, Any] = {}
    root = Path(out)
    for name in nutp:
        model, ddp, _ = stock_build(init=False)
        stock_load(ddp, root / f"nutp_{name}" / f"iter_{SAVE_AT:07d}")
        res[f"logits/{name}"] = stock_logits(model)
        if tp == 1:
            res[f"meta/{name}"] = dcp_metadata(root / f"nutp_{name}" / f"iter_{SAVE_AT:07d}")
            res["stock_model_keys"] = {
                v.key: tuple(v.global_shape) for v in _sharded(model.sharded_state_dict())}
    stock_root = root / f"stock_tp{tp}"
    if tp == 1:
        model, ddp, opt = stock_build(init=True)
        stock_save(ddp, opt, root / "stock_init", 0)
    else:  # megatron's own resharding of the TP1 initial weights
        model, ddp, opt = stock_build(init=False)
        stock_load(ddp, root / "stock_init" / "iter_0000000")
    res["fresh"] = [stock_step(ddp, opt, k) for k in range(SAVE_AT)]
    saved = stock_save(ddp, opt, stock_root, SAVE_AT)
    res["meta/stock"] = dcp_metadata(saved)
    res["full"] = [stock_step(ddp, opt, k) for k in range(SAVE_AT, SAVE_AT + AFTER)]
    model, ddp, opt = stock_build(init=False)
    stock_load(ddp, saved)
    res["weights"] = [stock_step(ddp, opt, k) for k in range(AFTER)]
    if rank0:
        torch.save(res, os.path.join(out, f"stock_tp{tp}.pt"))
    parallel_state.destroy_model_parallel()
    dist.barrier()


def _sharded(sd: dict[str, Any]) -> list[Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for v in sd.values():
        if isinstance(v, ShardedTensorFactory):
            out += [t for t in v.build() if isinstance(t, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def worker(rank: int, world: int, port: int, task: str, args: tuple[Any, ...],
           outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    fn = {"nutp_save": nutp_save, "nutp_resume": nutp_resume, "stock": stock_world}[task]
    gloo_rank(rank, world, port, outdir, lambda: fn(*args, outdir))
