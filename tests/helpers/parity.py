"""Parity harness: NUTP layouts vs stock single-process megatron-core (``reference.py``).

Per test, one single-process spawn trains every case's reference (stock megatron, TP1) and saves
it; then one spawned NUTP world trains the cases. For every case and step, every rank's grad norm
is gathered (all must be the same bits), every replica's parameters are assembled into global
tensors (replicas must be bitwise equal); at step 0 every synchronised gradient is assembled and
compared with the reference's ``main_grad`` (gradient level, before the optimizer). Rank 0 writes
one JSON of errors per case for the test to assert.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_nutp.model.init import normalize_name

TOL = 1e-5
CLIP = 0.05  # below every step's grad norm of the tiny models: every step clips
# tiny defaults: 8 heads / 4 query groups, SwiGLU, vocab 101
GQA_SWIGLU = dict(add_bias_linear=True)
TENSOR_TOL = 5e-5  # per tensor under Adam: see tests/train/test_parity.py
BF16_TOL = 2e-2  # bf16 vs stock single-process bf16, 5 steps: see test_parity.py (measured)


@dataclass(frozen=True)
class Case:
    name: str
    replicas: tuple[Any, ...]  # a degree per replica, or per replica a degree per stage
    model: dict[str, Any] = field(default_factory=dict)
    global_batch: int = 8  # micro-batches
    micro_batch_size: int = 2
    steps: int = 5
    sequence_parallel: bool = False
    sync_layout: str = "refine"
    bucket_size: int | None = None
    control: str | None = None  # negative controls, see _apply_control
    vs_megatron_ddp: bool = False  # uniform layouts: also train plain megatron DDP
    lr: float = 1e-3
    optimizer: str = "adam"
    clip_grad: float = 0.0
    precision: str = "fp32"
    initial_loss_scale: float = 2.0 ** 12
    seed: int = 1234
    pp: int = 1
    vp: int = 1  # virtual pipeline stages (model chunks per rank; megatron's interleaving)
    zero_redundancy: bool = False  # distributed optimizer: recovery.live_redundancy
    weight_decay: float = 0.0  # the reference: megatron's constant schedule (wd_mult per group)
    data: str | None = None  # the reference's batches (reference.py ``load_batches``)
    ref_model: dict[str, Any] = field(default_factory=dict)  # negative controls: model fields
    # the reference alone changes (a feature switched off on one side)
    schedule: dict[str, Any] = field(default_factory=dict)  # lr schedule (megatron's names:
    # lr_warmup_iters, lr_warmup_init, lr_decay_style, lr_decay_iters, min_lr); {}: constant
    ref_schedule: dict[str, Any] | None = None  # negative controls: the reference's instead
    eval_interval: int = 0  # evaluate after every this-many steps (megatron's eval_interval)
    eval_iters: int = 1  # validation global batches per evaluation
    hf_path: str | None = None  # the reference: transformers' model of this HF folder, loaded
    # through Bridge's weight mapping (hf_reference.py), instead of stock megatron-core
    ref_hf: dict[str, Any] = field(default_factory=dict)  # negative controls: HF config fields
    # the HF reference alone changes


def make_plan(case: Case) -> Any:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan

    tb = max(max(r) if isinstance(r, tuple) else r for r in case.replicas)
    n = tb * case.pp * len(case.replicas)
    req = PlanRequest(cluster=ClusterSpec(num_gpus=n, domain_size=tb, gpus_per_node=tb),
                      model=ModelConfig(**case.model),
                      parallel=ParallelSpec(tp_base=tb, sequence_parallel=case.sequence_parallel,
                                            sync_layout=case.sync_layout, pp=case.pp,
                                            virtual_pipeline_model_parallel_size=case.vp),
                      replicas=case.replicas, global_batch=case.global_batch)
    return build_plan(req)


def run_references(cases: list[Case], outdir: Path) -> None:
    """Every case's stock-megatron reference, in one single-process spawn."""
    from tests.helpers.dist import spawn

    from .reference import reference_worker

    spawn(reference_worker, 1, (cases,), outdir)


def _replica_local_norm(session: Any, control: str) -> None:
    """Negative controls: the grad norm of each replica's *own* gradient (before the
    cross-replica reduction) — used per replica ("norm_per_replica"), or replica 0's for all
    ("norm_replica0")."""
    import torch.distributed as dist

    eng = session.model.nutp_engine
    acc = [0.0]
    post, finish = eng._post, eng.finish

    def _post(e: Any) -> None:
        if e.kind is not None or eng.ctx.tp_rank == 0:
            acc[0] += float(torch.sum(e.param.main_grad.double() ** 2))
        post(e)

    def _finish(*, strict: bool = False) -> None:
        was = eng.done
        finish(strict=strict)
        if eng.done and not was:
            t = torch.tensor([acc[0]], dtype=torch.float64)
            dist.all_reduce(t, group=eng.groups.tp)
            if control == "norm_replica0":
                dist.broadcast(t, src=session.plan.replicas[0].ranks[0][0],
                               group=eng.groups.stage)
            eng.grad_sumsq, acc[0] = float(t), 0.0

    eng._post, eng.finish = _post, _finish


def _tied_by_position(session: Any) -> None:
    """Negative control: pipeline tied embeddings paired by rank position (first-stage rank j
    with last-stage rank j mod degree, local rows by offset) instead of by vocab unit."""
    fin = session.pipeline.finalizer
    if fin.tied is None:
        return
    plan, ctx = session.plan, session.groups.ctx
    rep = plan.replicas[ctx.replica]
    first, last = rep.ranks[0], rep.ranks[-1]
    n = fin.tied.shape[0]

    def rows_of(stage: int, j: int) -> int:
        b = plan.unit_bounds(stage, "vocab", rep.tp[stage])
        return int(b[j + 1] - b[j])

    if fin.first:
        k = ctx.tp_rank % len(last)
        fin.pairs = [(last[k], 0, min(n, rows_of(plan.pp - 1, k)))]
    else:
        fin.pairs = [(first[j], 0, min(n, rows_of(0, j))) for j in range(len(first))
                     if j % len(last) == ctx.tp_rank]


def _apply_control(session: Any, control: str | None) -> None:
    eng = session.model.nutp_engine
    if control == "flat_offsets":  # the public reference's pairing: by flat offset, not unit
        for e in eng.order:
            if e.pos is not None:
                e.pos = torch.arange(e.pos.numel()).view_as(e.pos)
    elif control == "equal_weights":  # "average of replica averages"
        n = len(session.plan.replicas)
        eng.ctx = dataclasses.replace(eng.ctx, weight=1.0 / n)
    elif control in ("norm_per_replica", "norm_replica0"):
        _replica_local_norm(session, control)
    elif control == "tied_by_position":
        _tied_by_position(session)
    elif control == "vp_no_wrap":
        _no_wrap(session)
    else:
        assert control is None or control == "vp_contiguous_blocks", control


def _no_wrap(session: Any) -> None:
    """Negative control (virtual stages): the ring's wrap-around link (last stage -> first
    stage's next chunk, and its gradient back) removed: stage 0's later chunks see zeros."""
    comm, plan = session.pipeline.comm, session.plan
    stage = plan.rank_index[dist_rank()][1]
    if stage == 0:
        comm.recv_prev, comm.send_prev = [], []
    if stage == plan.pp - 1:
        comm.send_next, comm.recv_next = [], []
    inner = comm._communicate

    def communicate(**kw: Any) -> Any:
        t_prev, t_next, reqs = inner(**kw)
        for t, zero in ((t_prev, stage == 0), (t_next, stage == plan.pp - 1)):
            if t is not None and zero:
                t.data.zero_()
        return t_prev, t_next, reqs

    comm._communicate = communicate


def _contiguous_blocks(num_layers: int, pp: int, vp: int = 1) -> list[list[tuple[int, int]]]:
    """Negative control (virtual stages): chunk ``c`` of stage ``s`` holds block ``s * vp + c``
    (contiguous per stage), not megatron's interleaved ``c * pp + s``."""
    n = num_layers // (pp * vp)
    return [[((s * vp + c) * n, (s * vp + c + 1) * n) for c in range(vp)] for s in range(pp)]


def _shards(model: torch.nn.Module, *, grads: bool = False
            ) -> dict[str, tuple[str | None, Any, torch.Tensor]]:
    """name (in the whole model) -> (kind, units, local param or main_grad copy) of this rank.
    A pipeline's last-stage copy of a tied embedding must equal the first stage's: it is kept
    under its own name and checked in ``_gather_replicas``."""
    out = {}
    for name, p in model.named_parameters():
        t = p.main_grad if grads else p  # type: ignore[attr-defined]
        key = getattr(p, "nutp_name", normalize_name(name))
        if getattr(p, "nutp_tied_copy", False):
            key = "tied_copy:" + key
        out[key] = (getattr(p, "nutp_kind", None), getattr(p, "nutp_units", None),
                    t.detach().float().cpu().clone().view(p.shape))  # (CUDA: gathered on CPU)
    return out


def _gather_replicas(session: Any, *, grads: bool = False) -> list[dict[str, torch.Tensor]]:
    """Every replica's global tensors (on rank 0; [] elsewhere): params or main grads."""
    import torch.distributed as dist

    from nemo_nutp.model.assemble import assemble

    ctx = session.groups.ctx
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ctx.replica, ctx.stage, _shards(session.model, grads=grads)))
    if dist.get_rank() != 0:
        return []
    plan = session.plan
    out = []
    for i in range(len(plan.replicas)):
        merged: dict[str, torch.Tensor] = {}
        for stage in range(plan.pp):
            merged.update(assemble([s for r, st, s in gathered if (r, st) == (i, stage)],
                                   plan.request.model))
        for key in [k for k in merged if k.startswith("tied_copy:")]:
            copy = merged.pop(key)  # the last stage's copy: the same bits as the embedding
            TIED_COPIES_EQUAL.append(torch.equal(copy, merged["embedding.word_embeddings.weight"]))
        out.append(merged)
    return out


TIED_COPIES_EQUAL: list[bool] = []
"""Rank 0: per gathered replica with a pipelined tied embedding, whether the last stage's copy
equals the first stage's embedding bitwise (``check_parity`` asserts all)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| (Frobenius)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst element, relative to the tensor's largest magnitude (reported, not asserted)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _all_equal(reps: list[dict[str, torch.Tensor]]) -> bool:
    return all(torch.equal(o[k], reps[0][k]) for o in reps[1:] for k in reps[0])


def _train(case: Case, session: Any) -> dict[str, Any]:
    import torch.distributed as dist

    TIED_COPIES_EQUAL.clear()
    losses, norms, skipped, norms_bitwise, replicas_equal = [], [], [], True, True
    lrs: list[float | None] = []
    val_losses: dict[int, float] = {}
    grads: list[dict[str, torch.Tensor]] = []
    params: list[dict[str, torch.Tensor]] = []

    def at_sync() -> None:
        grads.extend(_gather_replicas(session, grads=True))

    for step in range(case.steps):
        # fp16 step 0 overflows by design (NaN/Inf gradients cannot be compared bitwise)
        hook = at_sync if step == 0 and case.precision != "fp16" else None
        res = session.step(step, after_sync=hook)
        lrs.append(session.lr)
        if case.eval_interval and (step + 1) % case.eval_interval == 0:
            k = (step + 1) // case.eval_interval - 1
            val_losses[step] = session.evaluate(k * case.eval_iters, case.eval_iters)
        losses.append(res.loss)
        norms.append(res.grad_norm)
        skipped.append(res.skipped)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, res.grad_norm)
        norms_bitwise &= len({repr(x) for x in every}) == 1
        params = _gather_replicas(session)
        if params:
            replicas_equal &= _all_equal(params)
    return {"losses": losses, "norms": norms, "skipped": skipped, "lrs": lrs,
            "val_losses": val_losses,
            "norms_bitwise": norms_bitwise, "replicas_equal": replicas_equal,
            "grads_replicas_equal": _all_equal(grads) if grads else True,
            "grads": grads[0] if grads else {}, "params": params[0] if params else {},
            "tied_copies_equal": all(TIED_COPIES_EQUAL)}


def _compare(case: Case, got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    def rel_list(a: list[float], b: list[float]) -> list[float]:
        return [abs(x - y) / abs(y) if y == y else (0.0 if x != x else float("inf"))
                for x, y in zip(a, b)]

    keys = sorted(ref["params"])
    grad_rel = {k: _rel(got["grads"][k], ref["grads"][k]) for k in keys if got["grads"]}
    per_param = {k: _rel(got["params"][k], ref["params"][k]) for k in keys}
    cat = torch.cat
    return {
        "case": case.name, "losses": got["losses"], "ref_losses": ref["losses"],
        "norms": got["norms"], "ref_norms": ref["grad_norms"],
        "skipped": got["skipped"], "ref_skipped": ref["skipped"],
        "lrs": got.get("lrs"), "ref_lrs": ref.get("lrs"),
        "val_losses": got.get("val_losses"), "ref_val_losses": ref.get("val_losses"),
        "val_rel": [abs(v - ref["val_losses"][k]) / abs(ref["val_losses"][k])
                    for k, v in got.get("val_losses", {}).items()],
        "loss_rel": rel_list(got["losses"], ref["losses"]),
        "norm_rel": rel_list(got["norms"], ref["grad_norms"]),
        "grad_rel": grad_rel, "grad_rel_max": max(grad_rel.values(), default=float("nan")),
        "per_param": per_param, "param_rel": max(per_param.values()),
        "param_rel_max": max(_rel_max(got["params"][k], ref["params"][k]) for k in keys),
        "model_rel": _rel(cat([got["params"][k].reshape(-1) for k in keys]),
                          cat([ref["params"][k].reshape(-1) for k in keys])),
        "norms_bitwise": got["norms_bitwise"], "replicas_equal": got["replicas_equal"],
        "grads_replicas_equal": got["grads_replicas_equal"],
        "tied_copies_equal": got["tied_copies_equal"],
    }


def run_case(case: Case, outdir: str, device: torch.device | None = None) -> None:
    """One case on this world (``device``: the rank's GPU under NCCL, tests/gpu/test_nccl.py;
    default CPU)."""
    import torch.distributed as dist

    import nemo_nutp.model.build as build

    plan = make_plan(case)
    chunk_layers = build.chunk_layers
    if case.control == "vp_contiguous_blocks":
        build.chunk_layers = _contiguous_blocks  # type: ignore[assignment]
    try:
        session = _build(case, plan, device)
    finally:
        build.chunk_layers = chunk_layers
    _apply_control(session, case.control)
    rep = _replicated_elems(plan, session.model)
    got = _train(case, session)
    megatron = _megatron_ddp(case, session) if case.vs_megatron_ddp else None
    if dist.get_rank() == 0:
        ref = torch.load(os.path.join(outdir, f"ref_{case.name}.pt"))
        result = _compare(case, got, ref)
        result.update(shares=[r.microbatches for r in plan.replicas],
                      global_tp_group_untouched=_no_global_groups(), replicated_elems=rep)
        if megatron is not None:
            result.update(megatron)
        with open(os.path.join(outdir, f"{case.name}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def _build(case: Case, plan: Any, device: torch.device | None) -> Any:
    from nemo_nutp.train.session import Precision, build_session
    from nemo_nutp.train.step import StepOptions

    return build_session(
        plan, plan.request.model, lr=case.lr, seed=case.seed, optimizer=case.optimizer,
        weight_decay=case.weight_decay, schedule=_schedule(case),
        micro_batch_size=case.micro_batch_size, bucket_size=case.bucket_size,
        opts=StepOptions(clip_grad=case.clip_grad),
        precision=Precision(case.precision, initial_loss_scale=case.initial_loss_scale),
        device=device)


def _replicated_elems(plan: Any, model: torch.nn.Module) -> tuple[int, int]:
    """(this rank's replicated parameter elements, what the live move plans for its stage:
    ``relayout.plan.unit_elems(..., 'rep')``, which the memory model's count follows)."""
    from nemo_nutp.relayout.plan import REP, unit_elems

    stage = plan.rank_index[dist_rank()][1]
    have = sum(p.numel() for p in model.parameters()
               if p.nutp_kind is None and not p.nutp_tied_copy)  # type: ignore[attr-defined]
    return have, unit_elems(plan, stage, REP)


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _schedule(case: Case) -> Any:
    """nutp-train's schedule of a case (``train/schedule.py``), or None (constant)."""
    if not case.schedule:
        return None
    from nemo_nutp.train.schedule import Schedule

    names = {"lr_warmup_iters": "warmup_iters", "lr_warmup_init": "warmup_init",
             "lr_decay_style": "decay_style", "lr_decay_iters": "decay_iters",
             "min_lr": "min_lr"}
    return Schedule(lr=case.lr, weight_decay=case.weight_decay,
                    **{names[k]: v for k, v in case.schedule.items()})


def _no_global_groups() -> bool:
    from megatron.core import parallel_state as ps

    return ps._TENSOR_MODEL_PARALLEL_GROUP is None and ps._DATA_PARALLEL_GROUP is None


def _megatron_ddp(case: Case, nutp_session: Any) -> dict[str, Any] | None:
    """Uniform layouts: plain megatron-core DDP over the same-TP-position DP groups."""
    import copy

    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from nemo_nutp.model import build_gpt_model, transformer_config
    from nemo_nutp.model.assemble import local_shards
    from nemo_nutp.train.step import build_optimizer, reduce_replica_loss, train_step

    plan, groups = nutp_session.plan, nutp_session.groups
    ctx = groups.ctx
    position_group = None
    for key, g in groups.sync.items():  # uniform + refine: sync groups are the DP groups
        if key[1] == "qg":
            position_group = g
    pgs = copy.copy(groups.pgs)
    pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = pgs.expt_dp = position_group
    cfg = plan.request.model
    module = build_gpt_model(plan, ctx.rank, cfg, pgs, seed=case.seed)
    ddp = DistributedDataParallel(transformer_config(cfg, degree=ctx.degree),
                                  DistributedDataParallelConfig(), module, pg_collection=pgs)
    opt = build_optimizer(ddp, pgs, lr=case.lr, optimizer=case.optimizer)
    losses = []
    for step in range(case.steps):
        loss, _, _, _ = train_step(ddp, opt, nutp_session.batches(step), nutp_session.mask)
        losses.append(reduce_replica_loss(loss, weight=ctx.weight, degree=ctx.degree,
                                          stage_group=groups.stage))
    mine, theirs = local_shards(nutp_session.gpt), local_shards(module)
    bitwise = all(torch.equal(mine[k][2], theirs[k][2]) for k in mine)
    maxdiff = max(float((mine[k][2] - theirs[k][2]).abs().max()) for k in mine)
    flags = torch.tensor([float(bitwise), maxdiff])
    dist.all_reduce(flags[1:], op=dist.ReduceOp.MAX)
    dist.all_reduce(flags[:1], op=dist.ReduceOp.MIN)
    return {"megatron_losses": losses, "megatron_bitwise": bool(flags[0] == 1.0),
            "megatron_maxdiff": float(flags[1])}


def worker(rank: int, world: int, port: int, cases: list[Case], outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        for case in cases:
            run_case(case, outdir)

    gloo_rank(rank, world, port, outdir, body)


def run_cases(cases: list[Case], world: int, tmp_path: Path) -> dict[str, dict[str, Any]]:
    from tests.helpers.dist import spawn

    run_references(cases, tmp_path)
    spawn(worker, world, (cases,), tmp_path)
    res = {c.name: json.loads((tmp_path / f"{c.name}.json").read_text()) for c in cases}
    for name, r in res.items():  # shown with -s / on failure
        print(f"{name}: shares={r['shares']} loss_rel={max(r['loss_rel']):.2e} "
              f"norm_rel={max(r['norm_rel']):.2e} grad_rel={r['grad_rel_max']:.2e} "
              f"model_rel={r['model_rel']:.2e} param_rel={r['param_rel']:.2e} "
              f"param_rel_max={r['param_rel_max']:.2e} replicas_equal={r['replicas_equal']} "
              f"norms_bitwise={r['norms_bitwise']} skipped={r['skipped']}")
    return res


def check_parity(r: dict[str, Any], *, clip: float = 0.0, tol: float = TOL,
                 tensor_tol: float = TENSOR_TOL) -> None:
    assert r["replicas_equal"], "replicas' assembled parameters differ"
    assert r["grads_replicas_equal"], "replicas' synchronised gradients differ"
    assert r["norms_bitwise"], "ranks reported different grad-norm bits"
    assert r.get("tied_copies_equal", True), "a pipeline's tied output copy differs from the " \
        "first stage's embedding"
    assert r["skipped"] == r["ref_skipped"], (r["skipped"], r["ref_skipped"])
    assert max(r["loss_rel"]) <= tol, r["loss_rel"]
    assert max(r["norm_rel"]) <= tol, r["norm_rel"]
    assert r["grad_rel_max"] <= tol, r["grad_rel"]
    assert r["model_rel"] <= tol, r["model_rel"]
    if tensor_tol:  # bf16: not per tensor (see the module docstring)
        assert r["param_rel"] <= tensor_tol, r["param_rel"]
    assert r["global_tp_group_untouched"], "megatron's global parallel_state was initialised"
    have, planned = r.get("replicated_elems", (0, 0))
    assert have == planned, f"replicated elements {have}, the live move plans {planned}"
    if clip:  # the threshold is below every step's norm: every step clipped
        assert min(x for x in r["ref_norms"] if x == x) > clip, r["ref_norms"]


def check_cases(res: dict[str, dict[str, Any]], cases: list[Case]) -> None:
    """``check_parity`` at each case's precision (controls and fp16 are asserted apart)."""
    for c in cases:
        if (c.control or c.ref_model or c.ref_hf or c.ref_schedule is not None
                or c.precision == "fp16"):
            continue
        if c.precision == "bf16":
            check_parity(res[c.name], clip=c.clip_grad, tol=BF16_TOL, tensor_tol=0.0)
        else:
            check_parity(res[c.name], clip=c.clip_grad,
                         tensor_tol=TOL if c.optimizer == "sgd" else TENSOR_TOL)
