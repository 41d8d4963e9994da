"""``nutp-bridge`` saves and resumes its own MoE checkpoints (Bridge's ``train()`` saving through
NUTP's store: megatron's MoE keys, ``checkpoint/sharding.py``) on the shrunk Qwen3-MoE recipe of
``bridge_moe_jobs``: two runs in one world, the second resuming the first's checkpoint in
another layout."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch


def resume_worker(rank: int, world: int, port: int, first: list[str], second: list[str],
                  outdir: str) -> None:
    """``first`` (it saves), then ``second`` (it resumes one of ``first``'s checkpoints);
    rank 0 writes both records (steps, saved, loaded, whether the replicas end bitwise
    equal) as ``moe_resume.json``."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan
        from tests.helpers.bridge_moe_jobs import load
        from tests.helpers.moe_jobs import gather_replicas
        from tests.helpers.moe_reference import reset_moe_globals

        out = []
        for overrides in (first, second):
            reset_moe_globals()
            job = load(overrides)
            plan = build_plan(plan_request(job.nutp))
            got = train_rank(job, plan, outdir, seed=job.nutp.train.seed)
            reps = gather_replicas(SimpleNamespace(groups=got["groups"], model=got["model"],
                                                   plan=plan, model_cfg=job.nutp.model))
            equal = reps is not None and all(torch.equal(r[k], reps[0][k]) for r in reps[1:]
                                             for k in reps[0])
            out.append({"steps": got["steps"], "saved": got["saved"], "loaded": got["loaded"],
                        "replica_tp": [list(r.tp) for r in plan.replicas],
                        "replicas_bitwise_equal": equal})
        if rank == 0:
            Path(outdir, "moe_resume.json").write_text(json.dumps(out, default=str))

    gloo_rank(rank, world, port, outdir, body)
