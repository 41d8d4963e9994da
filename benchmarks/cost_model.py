"""Stage cost model vs measured CPU runs: each replica's predicted relative speed next to the
measured one, for several pipeline layouts with per-stage TP degrees.

Measured: for every (pipeline depth, stage, degree) a layout needs, a gloo world of ``degree``
ranks builds that stage's part of the model with the NUTP spec (``nutp_block_spec``,
``NUTPGPTModel(pre_process=..., post_process=...)``, ``num_layers`` = the stage's layers) and
times forward + backward of one micro-batch as **CPU time of the rank's thread**
(``time.thread_time``, one torch thread), so oversubscribed cores do not blur it. A stage's time
is its slowest rank's fastest repetition (other work on the machine only adds CPU time, through
cache and memory contention); a replica's is its slowest stage's.

Predicted: the planner (``build_plan`` with explicit per-stage ``replicas``) with a CPU
``CostSpec`` calibrated from single-purpose runs, never from the layouts' results: FLOP/s, the
fixed per-layer cost (operator dispatch, which does not shrink with the degree) and the cost per
element of the embedding table's dense gradient from three one-rank whole-model runs (degree 1,
pp=1: at ``--mbs``, at half of it — the FLOPs halve, fixed costs do not — and at half the
vocabulary); TP and point-to-point "bandwidth" and the per-message cost from the thread
CPU time of a gloo all-reduce / send+recv of a known size in a 2-rank world (the same clock the
stages are measured with).

Relative speed of replica i = time of the layout's first (healthiest) replica / time of replica i.
Target: |predicted / measured - 1| <= 0.10 for every replica.

Usage: python benchmarks/cost_model.py [--reps 5] [--warmup 2] [--hidden 512] [--out PATH]
Writes runs/bench/cost_model.json (+ .png) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from _gloo import init_cpu_rank  # benchmarks/_gloo.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {
    "pp2 [[2,2],[2,1]]": (2, ((2, 2), (2, 1))),
    "pp2 [[2,2],[1,2]]": (2, ((2, 2), (1, 2))),
    "pp1 [2],[1]": (1, ((2,), (1,))),
    "pp1 [4],[3],[2]": (1, ((4,), (3,), (2,))),
    "pp2 [[3,3],[3,2]]": (2, ((3, 3), (3, 2))),
}
"""name -> (pp, per-replica per-stage degrees); the first replica is the reference."""


def _dims(args: argparse.Namespace, num_layers: int, vocab: int | None = None) -> Any:
    from nemo_nutp.config import ModelConfig

    h = args.hidden
    return ModelConfig(num_layers=num_layers, hidden_size=h, num_attention_heads=8,
                       num_query_groups=4, ffn_hidden_size=3 * h, vocab_size=vocab or args.vocab,
                       seq_length=args.seq)


def _pgs(rank: int, world: int) -> Any:
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp = dist.new_group(list(range(world)))
    single = None
    for r in range(world):
        g = dist.new_group([r])
        single = g if r == rank else single
    pgs = ProcessGroupCollection()
    pgs.tp = pgs.tp_cp = pgs.mp = pgs.tp_ep_pp = pgs.expt_tp = pgs.tp_ep = tp
    pgs.cp = pgs.pp = pgs.ep = pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = pgs.expt_dp = single
    pgs.embd = pgs.pos_embd = None
    return pgs


def _stage_worker(rank: int, world: int, port: int, case: dict[str, Any],
                  args: argparse.Namespace, out: str) -> None:
    """Time forward + backward of one stage at degree ``world`` (thread CPU seconds)."""
    init_cpu_rank(rank, world, port)
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from nemo_nutp.model.build import (
        load_global_init,
        nutp_block_spec,
        transformer_config,
        unit_range,
    )
    from nemo_nutp.model.layers import NUTPGPTModel
    from nemo_nutp.train.session import causal_mask

    parallel_state._set_global_memory_buffer()  # scratch buffers only; no groups
    tensor_parallel.model_parallel_cuda_manual_seed(1, tp_rank=rank, ep_rank=0, etp_rank=0)
    pp, stage = case["pp"], case["stage"]
    dims = _dims(args, args.layers // pp, case.get("vocab"))
    pgs = _pgs(rank, world)
    pre, post = stage == 0, stage == pp - 1
    model = NUTPGPTModel(
        transformer_config(dims, degree=world),
        nutp_block_spec(dims, degree=world, tp_rank=rank, tp_group=pgs.tp),
        vocab_range=unit_range(dims, "word_embedding", world, rank),
        max_sequence_length=dims.seq_length, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, parallel_output=True, pg_collection=pgs,
        pre_process=pre, post_process=post)
    load_global_init(model, dims, degree=world, tp_rank=rank, seed=1)
    b, s, h = case.get("mbs", args.mbs), dims.seq_length, dims.hidden_size
    gen = torch.Generator().manual_seed(0)
    mask = causal_mask(s)
    pos = torch.arange(s)[None].expand(b, s)
    times = []
    for _ in range(args.warmup + args.reps):
        tokens = torch.randint(0, dims.vocab_size, (b, s), generator=gen)
        labels = torch.randint(0, dims.vocab_size, (b, s), generator=gen)
        x = torch.randn(s, b, h, generator=gen, requires_grad=True)
        grad = torch.randn(s, b, h, generator=gen)
        dist.barrier()
        t0 = time.thread_time()
        if not pre:
            model.set_input_tensor(x)
        y = model(tokens if pre else None, pos, mask, labels=labels if post else None)
        (y.float().mean() if post else (y * grad).sum()).backward()
        times.append(time.thread_time() - t0)
        model.zero_grad(set_to_none=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(times[args.warmup:]))


def _comm_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Thread CPU seconds of an all-reduce / send+recv of ``n`` fp32 elements, and of a tiny
    all-reduce (the per-message cost)."""
    init_cpu_rank(rank, world, port)
    import torch.distributed as dist

    n = args.mbs * args.seq * args.hidden
    big, tiny = torch.randn(n), torch.randn(1)
    res: dict[str, list[float]] = {"allreduce": [], "p2p": [], "tiny": []}
    for _ in range(args.warmup + 4 * args.reps):
        dist.barrier()
        t0 = time.thread_time()
        dist.all_reduce(big)
        res["allreduce"].append(time.thread_time() - t0)
        dist.barrier()
        t0 = time.thread_time()
        if rank == 0:
            dist.send(big, 1)
        else:
            dist.recv(big, 0)
        res["p2p"].append(time.thread_time() - t0)
        t0 = time.thread_time()
        dist.all_reduce(tiny)
        res["tiny"].append(time.thread_time() - t0)
    Path(out, f"comm{rank}.json").write_text(json.dumps({"n": n, **res}))


def _spawn(fn: Any, world: int, *extra: Any) -> Path:
    from nemo_nutp.common.ports import free_port

    tmp = Path(tempfile.mkdtemp(prefix="nutp_cost_"))
    mp.spawn(fn, args=(world, free_port(), *extra, str(tmp)), nprocs=world)
    return tmp


def measure_stage(pp: int, stage: int, degree: int, args: argparse.Namespace,
                  mbs: int | None = None, vocab: int | None = None) -> dict[str, Any]:
    """The stage's time: its slowest rank's fastest repetition (other work on the machine only
    ever adds CPU time through cache and memory contention, so the minimum is the estimate)."""
    case = {"pp": pp, "stage": stage, "mbs": mbs or args.mbs, "vocab": vocab or args.vocab}
    tmp = _spawn(_stage_worker, degree, case, args)
    per_rank = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(degree)]
    return {**case, "degree": degree, "seconds": max(min(x) for x in per_rank),
            "per_rank_min": [min(x) for x in per_rank],
            "per_rank_median": [statistics.median(x) for x in per_rank], "raw": per_rank}


def calibrate(args: argparse.Namespace, tp1: dict[str, Any], half: dict[str, Any],
              small_vocab: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The CPU ``CostSpec`` from single-purpose runs only: three one-rank whole-model runs at
    (``--mbs``, ``--vocab``), (half the micro-batch: the FLOPs halve, fixed costs do not) and
    (half the vocabulary: the embedding table's dense gradient halves) give FLOP/s, the
    per-layer fixed cost and the per-table-element cost; comm from the 2-rank run."""
    from nemo_nutp.layout.cost import CostSpec, stage_flops

    tokens, h, v, n = args.mbs * args.seq, args.hidden, args.vocab, args.layers
    f1 = stage_flops(_dims(args, n), 1, n, with_vocab=True, tokens=tokens)
    f3 = stage_flops(_dims(args, n, v // 2), 1, n, with_vocab=True, tokens=tokens)
    t1, t2, t3 = tp1["seconds"], half["seconds"], small_vocab["seconds"]
    flops = f1 / max(2.0 * (t1 - t2), 1e-9)  # t1 - t2 = f1 / (2 F)
    table = max(2.0 * (t1 - t3 - (f1 - f3) / flops) / ((v - v // 2) * 2 * h), 0.0)
    overhead = max(t1 - f1 / flops - v * h * table, 0.0) / n
    tmp = _spawn(_comm_worker, 2, args)
    raw = [json.loads((tmp / f"comm{r}.json").read_text()) for r in range(2)]
    med = {k: max(statistics.median(r[k][args.warmup:]) for r in raw)
           for k in ("allreduce", "p2p", "tiny")}
    nbytes = raw[0]["n"] * 4
    # a 2-rank ring all-reduce moves 2 (t-1)/t = 1 x the buffer per rank
    tp_gbps = nbytes / max(med["allreduce"] - med["tiny"], 1e-9) / 1e9
    p2p_gbps = nbytes / max(med["p2p"] - med["tiny"], 1e-9) / 1e9
    spec = CostSpec(flops=flops, tp_gbps=tp_gbps, p2p_gbps=p2p_gbps,
                    tp_overlap=0.0, latency_s=med["tiny"], act_bytes=4,
                    layer_overhead_s=overhead, table_elem_s=table,
                    name="CPU thread time (calibrated)")
    return spec, {"tp1_whole_model_s": t1, "tp1_whole_model_half_batch_s": t2,
                  "tp1_whole_model_half_vocab_s": t3, "tp1_whole_model_flops": f1,
                  "comm_thread_s": med, "comm_bytes": nbytes,
                  "spec": {k: getattr(spec, k) for k in ("flops", "tp_gbps", "p2p_gbps",
                                                          "latency_s", "act_bytes",
                                                          "layer_overhead_s",
                                                          "table_elem_s")}}


def predict(args: argparse.Namespace, spec: Any, pp: int,
            replicas: tuple[tuple[int, ...], ...]) -> list[dict[str, Any]]:
    from nemo_nutp.layout import ClusterSpec, ParallelSpec, PlanRequest, build_plan
    from nemo_nutp.layout.plan import fit_cluster

    tb = max(max(r) for r in replicas)
    cluster = fit_cluster(ClusterSpec(tb, tb, tb), tb, len(replicas) * pp)
    plan = build_plan(PlanRequest(
        cluster=cluster, model=_dims(args, args.layers), parallel=ParallelSpec(tp_base=tb, pp=pp),
        replicas=replicas, global_batch=8 * len(replicas), micro_batch_size=args.mbs,
        cost=spec))
    by_tp = {r.tp: r for r in plan.replicas}
    return [{"tp": list(t), "speed": by_tp[t].speed,
             "stage_s": [x * (plan.unit_time_s or 0.0) for x in by_tp[t].stage_times]}
            for t in replicas]


def run(args: argparse.Namespace) -> dict[str, Any]:
    needed = sorted({(pp, s, d) for pp, reps in LAYOUTS.values() for r in reps
                     for s, d in enumerate(r)} | {(1, 0, 1)})
    measured = {}
    for pp, s, d in needed:
        print(f"measuring pp={pp} stage={s} degree={d} ...", flush=True)
        measured[(pp, s, d)] = measure_stage(pp, s, d, args)
    if args.mbs % 2:
        raise SystemExit(f"--mbs={args.mbs}: must be even (calibration halves it)")
    print("measuring the calibration runs (degree 1: half micro-batch, half vocab) ...",
          flush=True)
    half = measure_stage(1, 0, 1, args, mbs=args.mbs // 2)
    small_vocab = measure_stage(1, 0, 1, args, vocab=args.vocab // 2)
    spec, cal = calibrate(args, measured[(1, 0, 1)], half, small_vocab)
    rows = []
    for name, (pp, reps) in LAYOUTS.items():
        pred = predict(args, spec, pp, reps)
        meas = [max(measured[(pp, s, d)]["seconds"] for s, d in enumerate(r)) for r in reps]
        for i, r in enumerate(reps):
            p_rel, m_rel = pred[i]["speed"] / pred[0]["speed"], meas[0] / meas[i]
            rows.append({"layout": name, "replica": i, "tp": list(r),
                         "measured_stage_s": [measured[(pp, s, d)]["seconds"]
                                              for s, d in enumerate(r)],
                         "predicted_stage_s": pred[i]["stage_s"],
                         "predicted_rel": p_rel, "measured_rel": m_rel,
                         "error": p_rel / m_rel - 1.0})
    return {"args": vars(args), "calibration": cal, "rows": rows,
            "stages": [dict(v) for v in measured.values()],
            "max_abs_error": max(abs(r["error"]) for r in rows), "target": 0.10}


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Stage cost model: predicted vs measured relative replica speed "
                    "(thread CPU time per micro-batch of the slowest stage)")
    for c in ("layout", "replica", "TP per stage", "measured s/stage", "predicted s/stage",
              "predicted rel", "measured rel", "pred/meas - 1"):
        t.add_column(c, justify="right")
    for r in result["rows"]:
        ok = abs(r["error"]) <= result["target"]
        t.add_row(r["layout"], str(r["replica"]), "/".join(map(str, r["tp"])),
                  "/".join(f"{x:.3f}" for x in r["measured_stage_s"]),
                  "/".join(f"{x:.3f}" for x in r["predicted_stage_s"]),
                  f"{r['predicted_rel']:.3f}", f"{r['measured_rel']:.3f}",
                  f"[{'green' if ok else 'red'}]{r['error']:+.3f}[/]")
    Console(width=200).print(t)
    print(f"max |predicted/measured - 1| = {result['max_abs_error']:.3f} (target "
          f"{result['target']:.2f}); calibration: {result['calibration']['spec']}")


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    rows = [r for r in result["rows"] if r["replica"] > 0]  # the references sit at (1, 1)
    xs = [r["measured_rel"] for r in rows]
    ys = [r["predicted_rel"] for r in rows]
    ax.plot([0, 1.05], [0, 1.05], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([0, 1.05], [0, 0.945], [0, 1.155], color="0.9", label="±10%")
    ax.scatter(xs, ys)
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(f"{r['layout'].split()[0]} {'/'.join(map(str, r['tp']))}", (x, y),
                    fontsize=7, xytext=(3, -8), textcoords="offset points")
    ax.set_xlabel("measured relative speed (thread CPU time)")
    ax.set_ylabel("predicted relative speed (planner cost model)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, 1.05)
    ax.legend(loc="upper left")
    fig.tight_layout()
    from nemo_nutp.layout.serialize import atomic_path

    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=8, help="timed micro-batches per stage")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="whole-model layers (pp=2: 2/stage)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--out", default="runs/bench/cost_model.json")
    args = p.parse_args(argv)
    if args.layers % 2:
        raise SystemExit(f"--layers={args.layers}: must be even (pp=2 layouts)")
    from nemo_nutp.layout.serialize import write_json_atomic

    result = run(args)
    write_json_atomic(result, Path(args.out))
    _plot(result, Path(args.out).with_suffix(".png"))
    _table(result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
