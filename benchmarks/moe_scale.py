"""A DeepSeek-V3-sized MoE at TP8 on 10,240 GPUs with 1% failed GPUs, descriptors only (no
model, no processes): build_plan's time with the experts in the request, the expert space's
sync layout (shards, shard groups, what one rank owns) and the memory model's per-rank bytes.
Writes runs/bench/moe_scale.json; a few seconds on 2 cores.

The shape: 61 layers (the first 3 dense, ``moe_layer_freq``), hidden 7168, 256 routed experts of
width 2048, top-8, one shared expert (2048), dense FFN 18432, vocab 129280, sequence 4096.
``ModelDims`` has no multi-head latent attention: attention is GQA with 128 heads of 128 in 8
query groups (about 249M parameters a layer against MLA's 187M), so totals are close to, not
equal to, DeepSeek-V3's 671B.
Usage: python benchmarks/moe_scale.py [--gpus N] [--fail-frac F] [--repeat R]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from nemo_nutp.layout import ClusterSpec, HealthReport, ModelDims, ParallelSpec, PlanRequest
from nemo_nutp.layout.experts import expert_bounds, expert_sync_layout
from nemo_nutp.layout.memory import GIB, MemorySpec, rank_param_counts, stage_memory
from nemo_nutp.layout.plan import build_plan
from nemo_nutp.layout.specs import MoESpec

DSV3 = ModelDims(num_layers=61, hidden_size=7168, num_attention_heads=128, num_query_groups=8,
                 kv_channels=128, ffn_hidden_size=18432, vocab_size=129280, seq_length=4096)
DSV3_MOE = MoESpec(num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                   moe_shared_expert_intermediate_size=2048,
                   moe_layer_freq=(0,) * 3 + (1,) * 58)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=10240)
    ap.add_argument("--fail-frac", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="runs/bench/moe_scale.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    failed = tuple(int(g) for g in rng.choice(args.gpus, int(args.gpus * args.fail_frac),
                                              replace=False))
    table = Table(title=f"DeepSeek-V3-sized MoE (GQA for MLA), {args.gpus} GPUs, TP8, "
                        f"{len(failed)} failed, sequence parallel; params/rank and GiB/rank "
                        "of the most loaded rank, bf16 weights, fp32 grads, Adam, full recompute")
    for col in ("seq", "plan s", "TP", "replicas", "experts/rank", "expert shards",
                "owned/rank", "params/rank", "GiB Adam", "GiB +ZeRO-1"):
        table.add_column(col, justify="right")
    res: dict[str, object] = {"gpus": args.gpus, "failed": len(failed)}
    # 4096 (DeepSeek-V3's): sequence parallelism needs the degree to divide it, so a slice
    # with a failed GPU runs at 4; 4032 = 2^6 x 63 also admits 7 and 6 (uneven experts)
    for seq in (4096, 4032):
        dims = dataclasses.replace(DSV3, seq_length=seq)
        req = PlanRequest(cluster=ClusterSpec(args.gpus, 8, 8), model=dims,
                          parallel=ParallelSpec(tp_base=8, sequence_parallel=True),
                          health=HealthReport(failed), global_batch=4096, moe=DSV3_MOE)
        t_plan = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = build_plan(req)
            t_plan.append(time.perf_counter() - t0)
        degrees = [r.tp[0] for r in plan.replicas]
        t0 = time.perf_counter()
        lay = expert_sync_layout(DSV3_MOE.num_moe_experts, degrees, "refine")
        t_layout = time.perf_counter() - t0
        per_degree = {}
        for t in sorted(set(degrees), reverse=True):
            own = np.bincount(lay.owners[t], minlength=t)  # shards each TP rank owns
            t0 = time.perf_counter()
            params = rank_param_counts(dims, t, stage=0, pp=1, moe=DSV3_MOE)
            t_count = time.perf_counter() - t0
            mems = {}
            for name, zero in (("adam", False), ("adam+zero1", True)):
                spec = MemorySpec(gpu_memory_gib=141, distributed_optimizer=zero,
                                  replicas=len(plan.replicas), sequence_parallel=True,
                                  recompute_granularity="full", recompute_method="uniform")
                m = stage_memory(dims, t, spec, stage=0, pp=1, moe=DSV3_MOE)
                mems[name] = {"weights_gib": m.weights / GIB, "grads_gib": m.grads / GIB,
                              "optimizer_gib": m.optimizer / GIB,
                              "activations_gib": m.activations / GIB,
                              "total_gib": m.total / GIB}
            experts = np.diff(expert_bounds(DSV3_MOE.num_moe_experts, t))
            per_degree[t] = {"replicas": degrees.count(t),
                             "experts_per_rank": sorted({int(x) for x in experts}),
                             "owned_shards_max": int(own.max()),
                             "owned_shards_min": int(own.min()),
                             "params_per_rank_max": int(params.max()),
                             "rank_count_s": t_count, "memory": mems}
            table.add_row(str(seq), f"{min(t_plan):.3f}", str(t), str(degrees.count(t)),
                          "/".join(map(str, per_degree[t]["experts_per_rank"])),
                          str(lay.num_shards), f"{own.min()}-{own.max()}",
                          f"{params.max() / 1e9:.2f}B", f"{mems['adam']['total_gib']:.0f}",
                          f"{mems['adam+zero1']['total_gib']:.0f}")
        res[f"seq{seq}"] = {"plan_s": min(t_plan), "world_size": plan.world_size,
                            "replicas": len(plan.replicas),
                            "dropped_replicas": plan.dropped_replicas,
                            "expert_layout_s": t_layout, "expert_shards": lay.num_shards,
                            "expert_shard_groups": lay.num_shards,
                            "members_per_group": len(plan.replicas), "degrees": per_degree}
    res["total_params"] = int(rank_param_counts(DSV3, 1, stage=0, pp=1, moe=DSV3_MOE)[0])
    res["grad_norm_slots_per_rank"] = 2 * DSV3_MOE.num_moe_experts * sum(
        DSV3_MOE.pattern(DSV3.num_layers))
    Console(width=150).print(table)
    print(f"{res['total_params'] / 1e9:.1f}B parameters; every rank of every replica holds "
          f"{res['grad_norm_slots_per_rank']} fp64 expert grad-norm slots (the model's expert "
          "tensors)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
