"""Live state movement harness: 7 gloo ranks train, one "dies", 6 survivors move state in memory.

One spawned world of 7 processes runs every scenario:

1. (world of 7, old plan) per scenario: train ``SAVE_AT`` steps, save a checkpoint at that step
   and keep the session in memory;
2. the default group is destroyed; the rank on the dead GPU stops taking part (returns); the six
   survivors initialise a new world on a new port (new rank = ``rank_map``) in the same
   processes;
3. (world of 6, new plan) per scenario: build session A and ``move_state`` the old session into
   it; build session B and ``load_checkpoint`` the saved checkpoint into it. Compare A with B
   field by field, bitwise (params, fp32 masters, exp_avg, exp_avg_sq, step, param groups); A as
   built, before the move, must differ from B (negative control). Then A and B each train one
   more step (same loss and grad-norm bits), and A's replicas are assembled into global tensors
   for the test to compare with stock megatron-core.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

SAVE_AT = 3
CLIP = 0.05  # below every step's grad norm: every step clips
MODEL = dict(add_bias_linear=True)  # tiny: GQA 8 heads / 4 query groups, SwiGLU, vocab 101, biases
NEW_WORLD = 6


@dataclass(frozen=True)
class Scenario:
    name: str
    pp: int = 1
    precision: str = "fp32"
    sequence_parallel: bool = False


SCENARIOS = [Scenario("tp4_tp3_to_tp3_tp3"),
             Scenario("tp4_tp3_to_tp3_tp3_bf16", precision="bf16"),
             Scenario("pp2_22_21_to_22_11", pp=2)]
"""pp=1: 8 GPUs in 2 domains of 4, GPU 7 failed (TP4+TP3), then GPU 2 fails (TP3+TP3).
pp=2: 8 GPUs in domains of 2, tp_base 2, GPU 7 failed ([[2,2],[2,1]]), then GPU 4 fails
([[2,2],[1,1]]). In both the dead GPU is old rank 2, so one new world serves all."""

SWAP = (2, 5)
"""New ranks 2 and 5 trade places in the rank map (a CPU process is not tied to a GPU): with
pp=2 the two change pipeline stage (stage 0 <-> 1), so they receive a whole stage's state,
replicated parameters included; with pp=1 they change replica."""


def rank_map(sc: Scenario) -> dict[int, int]:
    from nemo_nutp.relayout import survivor_rank_map

    a, b = SWAP
    swap = {a: b, b: a}
    return {o: swap.get(n, n) for o, n in survivor_rank_map(*plans(sc)).items()}


def plans(sc: Scenario) -> tuple[Any, Any]:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout import ClusterSpec, HealthReport, ParallelSpec, PlanRequest, build_plan

    tb, dead = (4, 2) if sc.pp == 1 else (2, 4)
    req = PlanRequest(cluster=ClusterSpec(num_gpus=8, domain_size=tb, gpus_per_node=tb),
                      model=ModelConfig(**MODEL),
                      parallel=ParallelSpec(tp_base=tb, pp=sc.pp,
                                            sequence_parallel=sc.sequence_parallel),
                      health=HealthReport(failed_gpus=(7,)), global_batch=8)
    old = build_plan(req)
    return old, build_plan(dataclasses.replace(req, health=HealthReport(failed_gpus=(dead, 7))))


def _session(plan: Any, sc: Scenario) -> Any:
    from nemo_nutp.train.session import Precision, build_session
    from nemo_nutp.train.step import StepOptions

    return build_session(plan, plan.request.model, lr=1e-3, seed=1234, micro_batch_size=2,
                         precision=Precision(sc.precision), opts=StepOptions(clip_grad=CLIP))


def _fields(session: Any) -> dict[str, Any]:
    """name -> every moved tensor, the step and the param groups' settings (for comparison)."""
    from nemo_nutp.relayout.move import _inner, _params

    params, step = _params(session)
    out: dict[str, Any] = {f"{n}#{k}": t for n, p in params.items()
                           for k, t in enumerate(p.fields)}
    out["step"] = step
    for k, inner in enumerate(_inner(session.optimizer)):
        groups = inner.optimizer.state_dict()["param_groups"]
        out[f"groups{k}"] = [{a: b for a, b in g.items() if a != "params"} for g in groups]
        steps = {repr(st["step"]) for st in inner.optimizer.state.values() if "step" in st}
        out[f"steps{k}"] = sorted(steps)
    return out


def _mismatches(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    bad = [k for k in b if k not in a]
    for k, v in b.items():
        if k not in a:
            continue
        w = a[k]
        if torch.is_tensor(v):
            if not (torch.is_tensor(w) and w.dtype == v.dtype and torch.equal(w, v)):
                bad.append(k)
        elif w != v:
            bad.append(k)
    return bad


def unmatched(posted: list[list[tuple[int, int, str, int]]]) -> list[str]:
    """NCCL's rule for batched rounds, checked on what every rank posted: in each round, every
    send from a to b has exactly one receive of the same size posted by b from a in the SAME
    round (a round is one ``batch_isend_irecv``, waited before the next; gloo would also
    complete a receive posted a round later, NCCL would not)."""
    from collections import Counter

    sends = Counter((r, a, peer, n) for a, ops in enumerate(posted)
                    for r, peer, kind, n in ops if kind == "send")
    recvs = Counter((r, peer, b, n) for b, ops in enumerate(posted)
                    for r, peer, kind, n in ops if kind == "recv")
    return [f"round {r}: {a}->{b} {n} B x{sends[(r, a, b, n)]} vs {recvs[(r, a, b, n)]}"
            for r, a, b, n in sorted(set(sends) | set(recvs)) if sends[(r, a, b, n)]
            != recvs[(r, a, b, n)]]


def _train_old(sc: Scenario, outdir: str) -> tuple[Any, list[tuple[float, float]]]:
    from nemo_nutp.checkpoint import save_checkpoint

    old, _ = plans(sc)
    s = _session(old, sc)
    hist = []
    for k in range(SAVE_AT):
        r = s.step(k)
        hist.append((r.loss, r.grad_norm))
    save_checkpoint(s, os.path.join(outdir, f"ckpt_{sc.name}"), step=SAVE_AT)
    return s, hist


def _after(sc: Scenario, old_s: Any, hist: list[tuple[float, float]], outdir: str) -> None:
    import torch
    import torch.distributed as dist

    from nemo_nutp.checkpoint import load_checkpoint
    from nemo_nutp.relayout import plan_move
    from nemo_nutp.relayout.move import move_state
    from tests.helpers.parity import _gather_replicas

    old, new = plans(sc)
    bpe = 12 if sc.precision == "fp32" else 14
    move = plan_move(old, new, rank_map(sc), bytes_per_elem=bpe)
    a = _session(new, sc)
    fresh = {k: v.clone() if torch.is_tensor(v) else v for k, v in _fields(a).items()}
    rep = move_state(move, old=old_s, new=a, group=dist.group.WORLD, bucket_bytes=16 << 10)
    b = _session(new, sc)
    load_checkpoint(b, os.path.join(outdir, f"ckpt_{sc.name}", f"iter_{SAVE_AT:07d}"))
    fb = _fields(b)
    bad, control = _mismatches(_fields(a), fb), _mismatches(fresh, fb)
    ra, rb = a.step(SAVE_AT), b.step(SAVE_AT)
    same_step = repr((ra.loss, ra.grad_norm)) == repr((rb.loss, rb.grad_norm))
    params = _gather_replicas(a)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"bad": bad[:8], "n_bad": len(bad), "n_control": len(control),
                                   "n_fields": len(fb), "same_step": same_step,
                                   "report": rep.as_dict(), "posted": rep.posted})
    if dist.get_rank() != 0:
        return
    equal = all(torch.equal(p[k], params[0][k]) for p in params[1:] for k in params[0])
    torch.save({k: v for k, v in params[0].items()}, os.path.join(outdir, f"params_{sc.name}.pt"))
    res = {"ranks": every, "losses": [h[0] for h in hist] + [ra.loss],
           "norms": [h[1] for h in hist] + [ra.grad_norm], "replicas_equal": equal,
           "plan_received": move.received_bytes, "plan_lower_bound": move.lower_bound_bytes,
           "plan_sent": move.sent_bytes,
           "unmatched": unmatched([e["posted"] for e in every]),
           "rep_moved": sorted({p.dst for p in move.pieces
                                if p.space == "rep" and not move.is_local(p)})}
    with open(os.path.join(outdir, f"move_{sc.name}.json"), "w") as f:
        json.dump(res, f)


def worker(rank: int, world: int, port: int, port2: int, outdir: str) -> None:
    import traceback

    try:
        _body(rank, world, port, port2, outdir)
    except BaseException:
        with open(os.path.join(outdir, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _body(rank: int, world: int, port: int, port2: int, outdir: str) -> None:
    warnings.filterwarnings("ignore")
    from nemo_nutp.compat.cpu import apply_cpu_patches

    apply_cpu_patches()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    kept = {sc.name: _train_old(sc, outdir) for sc in SCENARIOS}
    maps = {repr(sorted(rank_map(sc).items())) for sc in SCENARIOS}
    assert len(maps) == 1, maps
    rmap = rank_map(SCENARIOS[0])
    dist.destroy_process_group()
    if rank not in rmap:  # the dead rank: takes no further part
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port2}", rank=rmap[rank],
                            world_size=NEW_WORLD)
    from nemo_nutp.checkpoint import integrity

    integrity._CONTROL = None  # it cached the old world's group (the live path resets it too)
    for sc in SCENARIOS:
        _after(sc, *kept[sc.name], outdir)
    dist.destroy_process_group()
