"""``nutp-bridge`` on a Qwen3-MoE recipe (Bridge's ``qwen3_30b_a3b_pretrain_config``, shrunk by
``tests/integrations/data/bridge_qwen3_moe_tiny.yaml``) and Bridge's own stock run of the same
recipe in one process (``bridge_stock.stock_rank``), each recording every router's routing map.

The stock run starts from NUTP's initial weights (``moe_reference.initial_weight``: a pure
function of seed and name, global expert index in expert names), set in Bridge's stock
``GPTModel`` before its optimizer exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

RECIPE = "megatron.bridge.recipes.qwen.qwen3_moe:qwen3_30b_a3b_pretrain_config"
TINY = Path(__file__).resolve().parents[1] / "integrations" / "data" / \
    "bridge_qwen3_moe_tiny.yaml"
CPU = ["model.pipeline_model_parallel_size=1", "model.virtual_pipeline_model_parallel_size=null",
       "model.context_parallel_size=1", "model.expert_model_parallel_size=1",
       "model.bf16=false", "model.fp16=false", "model.params_dtype=torch.float32",
       "model.cross_entropy_fusion_impl=native", "comm_overlap=null",
       "model.cuda_graph_impl=none",
       "model.apply_rope_fusion=false", "model.gradient_accumulation_fusion=false",
       "model.bias_activation_fusion=false", "model.masked_softmax_fusion=false",
       "model.bias_dropout_fusion=false", "model.deterministic_mode=false",
       "model.moe_token_dispatcher_type=alltoall", "model.moe_grouped_gemm=false",
       "model.moe_permute_fusion=false", "model.moe_router_fusion=false",
       "model.recompute_granularity=null", "model.recompute_method=null",
       "model.recompute_num_layers=null",
       "optimizer.use_precision_aware_optimizer=false", "ddp.use_distributed_optimizer=false",
       "ddp.overlap_param_gather=false", "checkpoint.load=null",
       "tokenizer.use_tokenizer_vocab_size=false", "tokenizer.tokenizer_type=NullTokenizer",
       "tokenizer.tokenizer_model=null"]
"""Around the shrunk model: one pipeline stage, fp32 (the recipe's bf16 off, with
``bridge_jobs.PARITY``), the CPU substitutions both runs make alike (megatron's native fused
cross entropy for TE's, the other fusions off; the MoE
kernels: the all-to-all dispatcher for the flex one, ``SequentialMLP`` experts for grouped GEMM,
the permute and router fusions off), Bridge's NullTokenizer and mock data, and no recompute
(not math: NUTP does not recompute, and the stock run's recomputed forwards would call each
router twice per step)."""

NUTP = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
        "nutp.replicas=[2,1]"]
"""NUTP's layout: a TP2 replica (4 experts a rank, sequence parallel) beside a TP1 one."""
STOCK = ["model.tensor_model_parallel_size=1", "model.sequence_parallel=false",
         "nutp.replicas=[1]"]
"""Bridge's stock run: one process (TP1, EP1, DP1)."""


def load(overrides: list[str]) -> Any:
    from nemo_nutp.integrations.bridge_config import load_bridge_job
    from tests.helpers.bridge_jobs import PARITY
    from tests.helpers.hf_offline import offline_hf

    offline_hf()
    return load_bridge_job(RECIPE, str(TINY), [*PARITY, *CPU, *overrides])


def record_all_routing() -> list[torch.Tensor]:
    """Every ``TopKRouter`` forward of this process appends its routing map (bool
    ``[tokens, E]``, rows in megatron's ``[s, b]`` order), recorded by wrapping the class's
    forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: list[torch.Tensor] = []
    real = TopKRouter.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        maps.append(out[1].detach().bool().clone())
        return out

    TopKRouter.forward = forward  # type: ignore[method-assign]
    return maps


def stock_worker(rank: int, world: int, port: int, overrides: list[str], outdir: str) -> None:
    """Bridge's stock run of the shrunk recipe from NUTP's initial weights; writes
    ``stock_rank0.json`` (per step) and ``stock_routing.pt``."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from tests.helpers.bridge_stock import stock_rank
        from tests.helpers.moe_reference import initial_weight, reset_moe_globals

        job = load([*STOCK, *overrides])
        d, seed = job.nutp.model, job.nutp.train.seed
        maps = record_all_routing()
        built: list[Any] = []

        def prepare(model: list[Any]) -> None:
            reset_moe_globals()
            built.extend(model)
            with torch.no_grad():
                for name, p in model[0].named_parameters():
                    p.copy_(initial_weight(d, seed, name, tuple(p.shape)))

        stock_rank(job, outdir, Path(outdir, "stock_init"), prepare=prepare)
        torch.save(maps, Path(outdir, "stock_routing.pt"))
        torch.save(expert_biases(built[0]), Path(outdir, "stock_bias.pt"))

    gloo_rank(rank, world, port, outdir, body)


def expert_biases(model: Any) -> list[torch.Tensor]:
    """Every router's aux-loss-free expert bias (``[E]``, fp32), in module order."""
    return [m.expert_bias.detach().clone() for m in model.modules()
            if getattr(m, "expert_bias", None) is not None]


def bias_per_replica(plan: Any, rank: int) -> None:
    """Negative control of the expert-bias update (``model.moe.update_expert_bias``): every
    router counts only its own replica's tokens (the replica's ranks as the count group, not the
    stage over all replicas). Collective: one group per replica, made on every rank."""
    import torch.distributed as dist

    from nemo_nutp.model import moe

    mine = None
    for i in range(len(plan.replicas)):
        ranks = sorted(r for r, (k, _, _) in plan.rank_index.items() if k == i)
        group = dist.new_group(ranks)
        if plan.rank_index[rank][0] == i:
            mine = group
    real = moe.update_expert_bias

    def update(model: Any) -> None:
        for m in model.modules():
            if getattr(m, "nutp_count_group", None) is not None:
                m.nutp_count_group = mine
        real(model)

    moe.update_expert_bias = update  # type: ignore[assignment]


def nutp_worker(rank: int, world: int, port: int, overrides: list[str], control: str | None,
                outdir: str) -> None:
    """``nutp-bridge``'s run of the shrunk recipe at [2,1]; rank 0 writes
    ``nutp_<control>.json``: per step the loss and grad norm (and whether every rank's grad
    norm is the same bits), the router flips against the stock run's routing maps, whether
    the replicas end bitwise equal, every router's expert bias (and, with the stock run's
    ``stock_bias.pt``, whether it equals the stock run's bits). ``control='aux_per_rank'``
    (negative control): each TP rank counts the aux loss of its replica's tokens once per TP
    rank (the coefficient times the degree); ``'bias_per_replica'``: the expert-bias update
    counts each replica's tokens only (``bias_per_replica``)."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import dataclasses

        import torch.distributed as dist

        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations import bridge_run
        from nemo_nutp.layout import build_plan
        from tests.helpers.moe_jobs import gather_replicas
        from tests.helpers.moe_reference import reset_moe_globals

        reset_moe_globals()
        job = load([*NUTP, *overrides])
        plan = build_plan(plan_request(job.nutp))
        if control == "aux_per_rank":
            degree = plan.replicas[plan.rank_index[rank][0]].tp[0]
            real = bridge_run.moe_of

            def moe_of(provider: Any) -> Any:
                moe = real(provider)
                return None if moe is None else dataclasses.replace(
                    moe, moe_aux_loss_coeff=moe.moe_aux_loss_coeff * degree)

            bridge_run.moe_of = moe_of  # type: ignore[assignment]
        if control == "bias_per_replica":
            bias_per_replica(plan, rank)
        maps = record_all_routing()
        got = bridge_run.train_rank(job, plan, outdir, seed=job.nutp.train.seed)
        groups = got["groups"]
        ctx = groups.ctx
        tp = groups.tp
        full = []
        for m in maps:  # the replica's routing: every TP rank's sequence shard, in [s, b] order
            parts = [torch.empty_like(m) for _ in range(tp.size())]
            dist.all_gather(parts, m.contiguous(), group=tp)
            full.append(torch.cat(parts))
        norms: list[Any] = [None] * world
        dist.all_gather_object(norms, [s["grad_norm"] for s in got["steps"]])
        ref = torch.load(Path(outdir, "stock_routing.pt"))
        moe = bridge_run.moe_of(job.bridge.model)  # routers a micro-batch: the MoE layers,
        layers = (sum(moe.moe_layers(job.nutp.model.num_layers))  # MTP layers' too
                  + int(job.bridge.model.mtp_num_layers or 0))
        steps = len(got["steps"])
        per_step = len(ref) // steps  # the stock run's router calls a step (M micro-batches)
        mine = len(full) // steps
        lo = ctx.microbatch_offset * layers
        flips = []
        for k in range(steps):
            want = ref[k * per_step + lo:k * per_step + lo + mine]
            have = full[k * mine:(k + 1) * mine]
            n = sum(int((a != b).any(dim=1).sum()) for a, b in zip(have, want, strict=True))
            flips.append(n if ctx.tp_rank == 0 else 0)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, flips)
        reps = gather_replicas(SimpleNamespace(groups=groups, model=got["model"], plan=plan,
                                               model_cfg=job.nutp.model))
        if rank != 0:
            return
        assert reps is not None
        out = {"steps": got["steps"], "norms_same_bits": all(n == norms[0] for n in norms),
               "flips": [sum(f[k] for f in every) for k in range(steps)],
               "replicas_bitwise_equal": all(torch.equal(r[k], reps[0][k]) for r in reps[1:]
                                             for k in reps[0]),
               "tensors": len(reps[0]), "shares": [r.microbatches for r in plan.replicas],
               "expert_bias": [b.tolist() for b in expert_biases(got["model"])]}
        ref_bias = Path(outdir, "stock_bias.pt")
        if ref_bias.exists():  # the stock run's biases, bits compared
            want = torch.load(ref_bias)
            have = expert_biases(got["model"])
            out["bias_equal"] = len(want) == len(have) and all(
                torch.equal(a, b) for a, b in zip(have, want, strict=True))
            out["bias_max_diff"] = max((float((a - b).abs().max())
                                        for a, b in zip(have, want, strict=True)), default=0.0)
        Path(outdir, f"nutp_{control}.json").write_text(json.dumps(out))

    gloo_rank(rank, world, port, outdir, body)


def recipe_stock_worker(rank: int, world: int, port: int,
                        runs: list[tuple[str, str, list[str]]], outdir: str) -> None:
    """One process: Bridge's stock run of every MoE recipe in turn (``runs``: name, recipe
    spec, overrides making it one process), each from NUTP's initial weights; writes
    ``ref_<name>.pt`` (losses, grad norms, final parameters by name), the reference of
    ``benchmarks/recipe_coverage.py``'s MoE recipes. An MLA recipe's run takes
    ``bridge_mla_jobs``' named core-attention adapter, an MTP recipe's megatron's local MTP
    spec (``bridge_mtp_jobs.local_mtp_spec``), as ``bridge_mla_jobs.stock_mla_worker`` does."""
    from tests.helpers.dist import gloo_rank

    mtp_patched: list[bool] = []  # megatron's local MTP spec wraps its builder once

    def body() -> None:
        from tests.helpers.hf_offline import offline_hf

        offline_hf()
        for name, spec, overrides in runs:
            try:  # (a failure is recorded, the next recipe runs)
                stock_recipe(name, spec, overrides)
            except Exception as e:
                Path(outdir, f"ref_{name}.err").write_text(f"{type(e).__name__}: {e}")

    def stock_recipe(name: str, spec: str, overrides: list[str]) -> None:
        from nemo_nutp.integrations.bridge_config import load_bridge_job
        from nemo_nutp.model.init import normalize_name
        from tests.helpers.bridge_stock import stock_rank
        from tests.helpers.moe_reference import initial_weight, reset_moe_globals

        job = load_bridge_job(spec, None, overrides)
        if job.bridge.model.multi_latent_attention:  # as bridge_mla_jobs' stock run (for a
            # non-MLA attention the adapter is megatron's DotProductAttention)
            from tests.helpers.bridge_mla_jobs import local_mla_core_attention

            local_mla_core_attention()
        if job.bridge.model.mtp_num_layers and not mtp_patched:
            from tests.helpers.bridge_mtp_jobs import local_mtp_spec

            local_mtp_spec()
            mtp_patched.append(True)
        d, seed = job.nutp.model, job.nutp.train.seed
        built: list[Any] = []

        def prepare(model: list[Any]) -> None:
            reset_moe_globals()
            built.extend(model)
            with torch.no_grad():
                for pname, p in model[0].named_parameters():
                    p.copy_(initial_weight(d, seed, pname, tuple(p.shape)))

        record = stock_rank(job, outdir, Path(outdir, "stock_init"), prepare=prepare)
        params = {normalize_name(k): p.detach().float().clone()
                  for k, p in built[0].named_parameters()}
        torch.save({"losses": [r["loss"] for r in record],
                    "grad_norms": [r["grad_norm"] for r in record], "params": params},
                   Path(outdir, f"ref_{name}.pt"))

    gloo_rank(rank, world, port, outdir, body)


def rel(a: float, b: float) -> float:
    """``a``'s relative error against ``b``."""
    return abs(a - b) / max(abs(b), 1e-30)


def step_errors(run: dict, stock: list[dict], *, strict: bool = True) -> dict[str, list[float]]:
    """Each step's relative loss and grad-norm errors of a NUTP run against the stock run
    (``strict=False``: a shorter run, e.g. a one-step control)."""
    return {k: [rel(s[k], r[k]) for s, r in zip(run["steps"], stock, strict=strict)]
            for k in ("loss", "grad_norm")}


def check_bridge_parity(got: dict, stock: list[dict], bad: dict, *, tol: float, steps: int = 3,
                        strict_control: bool = True) -> dict[str, list[float]]:
    """What every Bridge MoE parity test asserts of ``nutp_worker``'s run ``got`` against
    Bridge's stock run: ``steps`` steps, no router flips, losses and grad norms within ``tol``,
    clipping active at every step, the same grad-norm bits on every rank, replicas bitwise
    equal. Prints everything; returns the control ``bad``'s errors for the test's own check."""
    errs, bad_errs = step_errors(got, stock), step_errors(bad, stock, strict=strict_control)
    print(json.dumps({"stock": stock, "nutp": got, "errors": errs, "control": bad,
                      "control_errors": bad_errs}))
    assert len(stock) == len(got["steps"]) == steps
    assert got["flips"] == [0] * steps  # every token routed to the stock run's experts
    for k in ("loss", "grad_norm"):
        assert max(errs[k]) <= tol, errs
    assert min(r["grad_norm"] for r in stock) > 0.05  # clipping active at every step
    assert got["norms_same_bits"] and got["replicas_bitwise_equal"]
    return bad_errs
