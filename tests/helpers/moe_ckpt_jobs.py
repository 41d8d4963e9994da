"""MoE checkpoints both ways with *stock* megatron-core 0.19.2 (``moe_reference.py``'s one-process
``GPTModel`` with MoE layers, ``SequentialMLP`` experts, EP1): worlds spawned by
``tests/checkpoint/test_moe_checkpoint.py``, every check computed here or there.

* ``stock_first`` (one process): the stock model from the case's initial weights trains
  ``SAVE_AT`` steps, saves like Megatron-LM (``stock.stock_save``: model and optimizer through
  megatron's own ``sharded_state_dict``, experts as ``...mlp.experts.experts.*`` with a global
  expert axis), trains ``AFTER`` more (``stock_continue``).
* ``nutp`` (NUTP layouts, one world): ``SAVE_FROM`` trains ``SAVE_AT`` steps, saves with
  ``save_checkpoint`` and trains ``AFTER`` more (``nutp_continue``); with the negative control
  it also saves the same state with the experts mislabelled (expert ``e`` as ``E-1-e``). Then
  each of ``RESUME`` loads the stock checkpoint (model and Adam state) into fresh weights and
  trains ``AFTER`` steps (``from_stock``), replicas compared bitwise after.
* ``stock_loads`` (one process): a fresh stock model and optimizer load each NUTP checkpoint
  with plain ``dist_checkpointing.load`` (``stock.stock_load``) and train ``AFTER`` steps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .moe_reference import MoECase, causal_mask, dims, step_batches

SAVE_AT, AFTER = 2, 2
CASE = MoECase(name="ckpt", steps=SAVE_AT + AFTER)
SAVE_FROM = (3, 2)
"""The NUTP layout that saves (experts 2/3/3 over the TP3 replica, 4/4 over the TP2 one)."""
RESUME = ((2, 2, 1), (3, 2))
"""The NUTP layouts that resume the stock checkpoint."""


# ------------------------------------------------------------------------------ stock side

def stock_steps(ddp: Any, opt: Any, steps: range) -> dict[str, Any]:
    """``stock_step`` for each of ``steps``: the losses, grad norms and the parameters after
    (by name, experts by global index, as ``moe_reference`` records them)."""
    from nemo_nutp.model.init import normalize_name

    rec: dict[str, Any] = {"losses": [], "norms": []}
    for k in steps:
        loss, norm = stock_step(ddp, opt, k)
        rec["losses"].append(loss)
        rec["norms"].append(norm)
    rec["params"] = {normalize_name(k): p.detach().float().clone()
                     for k, p in ddp.named_parameters()}
    return rec


def stock_step(ddp: Any, opt: Any, step: int) -> tuple[float, float]:
    """One step of ``moe_reference.run_moe_reference``'s loop (megatron's no-pipelining
    schedule written out); returns the mean micro-batch loss and megatron's grad norm."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from .moe_reference import aux_loss_of_step

    batches = step_batches(CASE, step)
    n = len(batches)
    mask = causal_mask(dims(CASE).seq_length)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    total = 0.0
    for i, mb in enumerate(batches):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n))
        if i < n - 1:
            with ddp.no_sync():
                loss = ddp(mb.tokens, mb.position_ids, mask, labels=mb.labels).float().mean()
                (loss / n).backward()
        else:
            loss = ddp(mb.tokens, mb.position_ids, mask, labels=mb.labels).float().mean()
            (loss / n).backward()
        total += float(loss.detach())
    ddp.finish_grad_sync()
    ok, norm, _ = opt.step()
    assert ok
    aux_loss_of_step(n)  # clears megatron's tracker
    return total / n, float(norm)


def _stock_init() -> None:
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(CASE.seed)


def stock_first(out: str) -> None:
    from megatron.core import parallel_state

    from .moe_reference import build, reset_moe_globals
    from .stock import stock_save

    _stock_init()
    reset_moe_globals()
    _model, ddp, opt = build(CASE)
    res: dict[str, Any] = {"stock_fresh": stock_steps(ddp, opt, range(SAVE_AT))}
    stock_save(ddp, opt, Path(out) / "stock", SAVE_AT)
    res["stock_continue"] = stock_steps(ddp, opt, range(SAVE_AT, SAVE_AT + AFTER))
    torch.save(res, os.path.join(out, "stock_first.pt"))
    parallel_state.destroy_model_parallel()


def stock_loads(names: list[str], out: str) -> None:
    from megatron.core import parallel_state

    from .moe_reference import build, reset_moe_globals
    from .stock import stock_load

    _stock_init()
    res: dict[str, Any] = {}
    for name in names:
        reset_moe_globals()
        _model, ddp, opt = build(CASE)  # the initial weights: all must come from the checkpoint
        try:
            stock_load(ddp, Path(out) / name / f"iter_{SAVE_AT:07d}", opt)
        except Exception as e:  # the negative control may fail to load at all
            res[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            continue
        res[name] = stock_steps(ddp, opt, range(SAVE_AT, SAVE_AT + AFTER))
    torch.save(res, os.path.join(out, "stock_loads.pt"))
    parallel_state.destroy_model_parallel()


# ------------------------------------------------------------------------------- NUTP side

def nutp_session(replicas: tuple[int, ...]) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan
    from nemo_nutp.train.session import build_session
    from nemo_nutp.train.step import StepOptions

    from .moe_jobs import moe_dims
    from .moe_reference import reset_moe_globals

    reset_moe_globals()
    tb = max(replicas)
    plan = build_plan(PlanRequest(
        cluster=ClusterSpec(num_gpus=tb * len(replicas), domain_size=tb, gpus_per_node=tb),
        model=ModelConfig(**CASE.model),
        parallel=ParallelSpec(tp_base=tb, sequence_parallel=True), replicas=replicas,
        global_batch=CASE.global_batch))
    return build_session(plan, dims(CASE), lr=CASE.lr, seed=CASE.seed,
                         micro_batch_size=CASE.micro_batch_size,
                         opts=StepOptions(clip_grad=CASE.clip_grad), moe=moe_dims(CASE))


def _mislabelled_experts() -> Any:
    """Negative control: ``sharding.expert_indices`` answering expert ``E-1-e`` for expert
    ``e`` (a writer that mislabels experts; returns the undo). Experts under their *local*
    indices, the other obvious mistake, megatron's own save refuses (duplicate keys)."""
    from nemo_nutp.checkpoint import sharding

    real = sharding.expert_indices
    num = CASE.moe.num_moe_experts

    def wrong(model: Any) -> dict[str, int]:
        return {k: num - 1 - e for k, e in real(model).items()}

    sharding.expert_indices = wrong  # type: ignore[assignment]

    def undo() -> None:
        sharding.expert_indices = real  # type: ignore[assignment]

    return undo


def nutp_steps(s: Any, steps: range) -> dict[str, Any]:
    """The session's losses and grad norms for ``steps``, then (rank 0) replica 0's global
    parameters and whether every replica's are bitwise equal."""
    from .moe_jobs import gather_replicas

    rec: dict[str, Any] = {"losses": [], "norms": []}
    for k in steps:
        res = s.step(k)
        rec["losses"].append(res.loss)
        rec["norms"].append(res.grad_norm)
    reps = gather_replicas(s)
    if reps is not None:
        rec["params"] = reps[0]
        rec["replicas_equal"] = all(torch.equal(r[k], reps[0][k]) for r in reps[1:]
                                    for k in reps[0])
    return rec


def nutp(control: bool, out: str) -> None:
    import torch.distributed as dist

    from nemo_nutp.checkpoint import load_checkpoint, save_checkpoint

    res: dict[str, Any] = {}
    world = dist.get_world_size()
    if sum(SAVE_FROM) == world:
        s = nutp_session(SAVE_FROM)
        res["nutp_fresh"] = nutp_steps(s, range(SAVE_AT))
        save_checkpoint(s, os.path.join(out, "nutp"), step=SAVE_AT)
        if control:
            undo = _mislabelled_experts()
            try:
                save_checkpoint(s, os.path.join(out, "nutp_mislabelled"), step=SAVE_AT)
            finally:
                undo()
        res["nutp_continue"] = nutp_steps(s, range(SAVE_AT, SAVE_AT + AFTER))
    for replicas in RESUME:
        if sum(replicas) != world:
            continue
        name = "_".join(map(str, replicas))
        s = nutp_session(replicas)
        info = load_checkpoint(s, os.path.join(out, "stock", f"iter_{SAVE_AT:07d}"))
        assert info["step"] == SAVE_AT and info["optimizer"], info
        res[f"from_stock_{name}"] = nutp_steps(s, range(SAVE_AT, SAVE_AT + AFTER))
    if dist.get_rank() == 0:
        torch.save(res, os.path.join(out, f"nutp_w{world}.pt"))
    dist.barrier()


def worker(rank: int, world: int, port: int, task: str, args: tuple[Any, ...],
           outdir: str) -> None:
    from .dist import gloo_rank

    fn = {"stock_first": stock_first, "stock_loads": stock_loads, "nutp": nutp}[task]
    gloo_rank(rank, world, port, outdir, lambda: fn(*args, outdir))
