"""The spawned world of ``tests/integrations/test_bridge_zero.py``: ``nutp-bridge`` with the
recipe's distributed optimizer (NUTP's ZeRO-1) through Bridge's ``train()``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def _state(opt: Any) -> dict[str, torch.Tensor]:
    """This rank's Adam state of its slices (flat, per param group), cloned."""
    return {f"{k}{i}": opt.optimizer.state[m][k].clone() for i, m in enumerate(opt.masters)
            for k in ("exp_avg", "exp_avg_sq")}


def zero_worker(rank: int, world: int, port: int, overrides: list[str], outdir: str) -> None:
    """One rank: train, count the optimizer state, reload the saved checkpoint into the same
    optimizer (its state must come back bitwise); rank 0 writes ``zero_result.json``."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import torch.distributed as dist

        from nemo_nutp.checkpoint.store import load_checkpoint
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_ckpt import session_of
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.integrations.bridge_zero import BridgeZeroOptimizer
        from nemo_nutp.layout import build_plan
        from tests.helpers.bridge_jobs import load
        from tests.helpers.parity import _gather_replicas

        job = load(overrides)
        plan = build_plan(plan_request(job.nutp))
        got = train_rank(job, plan, outdir, seed=job.nutp.train.seed)
        opt, model = got["optimizer"], got["model"]
        reps = _gather_replicas(SimpleNamespace(groups=got["groups"], model=model, plan=plan))
        before = _state(opt)
        mine = {"rank": rank, "zero": isinstance(opt, BridgeZeroOptimizer),
                "ddp_distributed": bool(model.ddp_config.use_distributed_optimizer),
                # what megatron's non-distributed Adam keeps per moment: this rank's params
                "local_numel": sum(p.numel() for p in model.parameters()),
                "state_numel": sum(int(t.numel()) for k, t in before.items()
                                   if k.startswith("exp_avg_sq")),
                "group_wd": sorted({float(g["weight_decay"]) for g in opt.param_groups}),
                "group_lr": sorted({float(g["lr"]) for g in opt.param_groups}),
                # ddp.overlap_param_gather: where each step's deferred gather completed
                "overlap": opt.overlap_param_gather, "settled": dict(opt.settled)}
        # Save -> load through the NUTP store (what Bridge's loop saved): the ZeRO state
        # returns bitwise into the slices.
        for t in opt.optimizer.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                t[k].zero_()
        load_checkpoint(session_of(model, plan, got["groups"], opt), got["saved"][-1])
        after = _state(opt)
        mine["reload_bitwise"] = all(torch.equal(before[k], after[k]) for k in before)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if rank != 0:
            return
        ref = torch.load(os.path.join(outdir, "ref_bridge.pt"))

        def rel(other: dict[str, Any]) -> dict[str, float]:
            return {k: float((v - other["params"][k]).norm() / other["params"][k].norm())
                    for k, v in reps[0].items()}

        out = {"steps": got["steps"], "ref_losses": ref["losses"],
               "ref_grad_norms": ref["grad_norms"], "ranks": every,
               "global_numel": sum(int(v.numel()) for v in reps[0].values()),
               "replicas_bitwise_equal": all(torch.equal(r[k], reps[0][k])
                                             for r in reps[1:] for k in reps[0]),
               "param_rel": rel(ref),
               "param_rel_no_wd": rel(torch.load(Path(outdir, "ref_bridge_no_wd.pt"))),
               "saved": got["saved"]}
        Path(outdir, "zero_result.json").write_text(json.dumps(out))

    gloo_rank(rank, world, port, outdir, body)
