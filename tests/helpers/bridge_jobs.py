"""Spawned worlds of the Bridge tests: NUTP through Bridge's ``train()`` (one world runs it and
compares on rank 0)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

RECIPE = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
TINY = Path(__file__).resolve().parents[1] / "integrations" / "data" / "bridge_tiny.yaml"
# What the parity runs set on the command line (YAML: shrink + dropout 0): fp32, Adam at a
# constant rate (the reference has no lr schedule), clipping on and active. Weight decay is the
# recipe's: its scheduler's constant 0.033 (``scheduler.start_weight_decay``, which overrides
# ``optimizer.weight_decay`` at every step, biases and 1-D parameters at wd_mult 0); the
# reference applies it with megatron's own OptimizerParamScheduler (tests/helpers/reference.py).
PARITY = ["mixed_precision=null", "optimizer.bf16=false",
          "optimizer.use_distributed_optimizer=false",
          "optimizer.adam_beta2=0.999", "optimizer.lr=0.001", "optimizer.min_lr=0.001",
          "optimizer.clip_grad=0.05",
          "scheduler.lr_decay_style=constant", "scheduler.lr_warmup_iters=0",
          "logger.tensorboard_dir=null", "checkpoint.save=null", "dataset.seq_length=32",
          "logger.log_interval=1"]


def load(overrides: list[str]) -> Any:
    from nemo_nutp.integrations.bridge_config import load_bridge_job

    return load_bridge_job(RECIPE, str(TINY), [*PARITY, *overrides])


def reference_case(job: Any, data: str | Path | None = None) -> Any:
    """The stock single-process megatron-core run of the same model, data and optimizer
    (``data``: the batches of ``reference_batches``)."""
    from tests.helpers.parity import Case

    t = job.nutp.train
    wd = job.bridge.scheduler
    assert wd.weight_decay_incr_style == "constant" and wd.start_weight_decay == \
        wd.end_weight_decay, "the reference's weight decay is constant"
    return Case(name="bridge", replicas=(1,), model=asdict(job.nutp.model),
                global_batch=t.num_microbatches, micro_batch_size=t.micro_batch_size,
                steps=t.steps, lr=0.001, clip_grad=0.05, seed=t.seed,
                weight_decay=t.weight_decay, data=None if data is None else str(data))


def reference_batches(overrides: list[str], path: Path) -> Path:
    """The recipe's dataset as ONE process trains it, written for the reference: Bridge's own
    dataset (``bridge_data.train_dataset``) and Bridge's own sampler for one data-parallel rank
    (``build_pretraining_data_loader``), ``train_iters`` global batches of micro-batches in
    order. Not the share sampler the NUTP ranks use (``bridge_data.ReplicaShareSampler``)."""
    from nemo_nutp.integrations.bridge_data import stock_loader, train_dataset
    from nemo_nutp.integrations.bridge_run import validate_as_uniform

    job = load(overrides)
    cfg = job.bridge
    validate_as_uniform(cfg, None)
    loader = iter(stock_loader(cfg, train_dataset(cfg, None), 0))
    m = job.nutp.train.num_microbatches
    steps = [[dict(next(loader)) for _ in range(m)] for _ in range(cfg.train.train_iters)]
    torch.save(steps, path)
    return path


def bridge_logged_losses() -> list[float]:
    """The ``lm loss`` Bridge's ``train()`` hands its ``training_log`` at every step (what it
    prints), recorded by wrapping that function for this process."""
    from megatron.bridge.training import train as bridge_train

    logged: list[float] = []
    log = bridge_train.training_log

    def training_log(loss_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        logged.append(float(loss_dict["lm loss"]))
        return log(loss_dict, *args, **kwargs)

    bridge_train.training_log = training_log
    return logged


class _Seen:
    """A data iterator that records each micro-batch's tokens as it hands it on."""

    def __init__(self, inner: Any, seen: list[Any]) -> None:
        self.inner, self.seen = inner, seen

    def __iter__(self) -> _Seen:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.seen.append(batch["tokens"].tolist())
        return batch


def tokens_seen() -> list[Any]:
    """The tokens of every micro-batch this process's Bridge training iterator
    (``bridge_data.train_iterator``) gives Bridge's ``train()``, recorded by wrapping it."""
    from nemo_nutp.integrations import bridge_data

    seen: list[Any] = []
    real = bridge_data.train_iterator

    def train_iterator(*args: Any, **kwargs: Any) -> Any:
        return _Seen(real(*args, **kwargs), seen)

    bridge_data.train_iterator = train_iterator  # type: ignore[assignment]
    return seen


def uniform_worker(rank: int, world: int, port: int, overrides: list[str], init: str,
                   outdir: str) -> None:
    """nutp-bridge's run of a uniform layout, from the weights of ``init`` (a checkpoint)."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan

        job = load(overrides)
        plan = build_plan(plan_request(job.nutp))
        got = train_rank(job, plan, outdir, seed=job.nutp.train.seed, init_from=init)
        if rank == 0:
            Path(outdir, "uniform_result.json").write_text(json.dumps(got["steps"]))

    gloo_rank(rank, world, port, outdir, body)


def resume_overrides(job: Any, root: str | Path, out: str | Path, *, replicas: list[int],
                     steps: int) -> list[str]:
    """``nutp-train``'s command line that resumes the Bridge run's checkpoint under ``root`` in
    another layout and trains on to ``steps``: the recipe's model, batch, optimizer and seed as
    ``nutp-bridge`` maps them (``bridge_keys``), NUTP's own keys of the job, then the layout."""
    from nemo_nutp.integrations.bridge_config import bridge_keys

    tb = max(replicas)
    return [*bridge_keys(job.bridge), *job.nutp_overrides, f"parallel.tp_base={tb}",
            f"nutp.replicas={json.dumps(replicas)}", f"train.steps={steps}",
            "train.large_grad_factor=0", f"checkpoint.load_dir={root}",
            "checkpoint.resume=required", f"output.dir={out}"]


def nutp_train_resume(overrides: list[str]) -> list[dict[str, Any]] | None:
    """``nutp-train``'s rank (``nemo_nutp.train.loop.train_rank``, what ``nutp-train``'s ranks
    run once their process group exists) in this world; rank 0 returns the metrics rows."""
    from nemo_nutp.config import plan_request
    from nemo_nutp.config.recipes import load_job
    from nemo_nutp.layout import build_plan
    from nemo_nutp.train.loop import train_rank

    cfg = load_job(overrides)
    return train_rank(cfg, build_plan(plan_request(cfg)))


def stock_loaded(case: Any, path: str) -> dict[str, torch.Tensor]:
    """Stock megatron-core loads the checkpoint at ``path``: its own ``GPTModel`` (local spec,
    megatron's global ``parallel_state`` at TP1 in this world) and a plain
    ``dist_checkpointing.load`` of the model's own sharded state dict, no adapter; its
    parameters by name (collective)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_nutp.config import ModelConfig
    from nemo_nutp.model.init import normalize_name
    from tests.helpers.reference import _config

    parallel_state.destroy_global_memory_buffer()  # NUTP's scratch buffer; megatron asserts
    parallel_state.initialize_model_parallel(1, 1)
    try:
        d = ModelConfig(**case.model)
        model = GPTModel(_config(case, d), get_gpt_layer_local_spec(normalization=d.normalization),
                         vocab_size=d.vocab_size, max_sequence_length=d.seq_length,
                         position_embedding_type=d.position_embedding_type,
                         share_embeddings_and_output_weights=d.tie_embeddings,
                         parallel_output=True)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(loaded["model"])
        return {normalize_name(k): p.detach().clone() for k, p in model.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()


def bridge_worker(rank: int, world: int, port: int, overrides: list[str],
                  resume: list[str] | None, outdir: str) -> None:
    """``nutp-bridge``'s run of ``overrides``; with ``resume`` (``nutp-train`` overrides, see
    ``resume_overrides``) ``nutp-train`` then resumes its checkpoint in the same world."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan
        from tests.helpers.parity import _gather_replicas

        job = load(overrides)
        plan = build_plan(plan_request(job.nutp))
        logged = bridge_logged_losses()
        seen = tokens_seen()
        got = train_rank(job, plan, outdir, seed=job.nutp.train.seed)
        reps = _gather_replicas(SimpleNamespace(groups=got["groups"], model=got["model"],
                                                plan=plan))
        mine = (logged, got["state"].train_state.consumed_train_samples, seen, got["replica"])
        every: list[Any] = [None] * world
        torch.distributed.all_gather_object(every, mine)
        resumed = stock = None
        t0 = time.perf_counter()
        if resume is not None:
            resumed = nutp_train_resume(resume)
            stock = stock_loaded(reference_case(job), got["saved"][-1])
        resume_s = time.perf_counter() - t0  # what the resume and the stock load add
        if rank != 0:
            return
        ref = torch.load(os.path.join(outdir, "ref_bridge.pt"))

        def rel(other: dict[str, Any]) -> dict[str, float]:
            return {k: float((v - other["params"][k]).norm() / other["params"][k].norm())
                    for k, v in reps[0].items()}

        params = rel(ref)
        no_wd = Path(outdir, "ref_bridge_no_wd.pt")
        params_no_wd = rel(torch.load(no_wd)) if no_wd.exists() else {}
        out = {"steps": got["steps"], "ref_losses": ref["losses"],
               "ref_grad_norms": ref["grad_norms"],
               "replicas_bitwise_equal": all(torch.equal(r[k], reps[0][k])
                                             for r in reps[1:] for k in reps[0]),
               "param_rel": params, "param_rel_no_wd": params_no_wd,
               "shares": [r.microbatches for r in plan.replicas],
               "bridge_lm_loss": [e[0] for e in every],
               "consumed_train_samples": [e[1] for e in every],
               "tokens_seen": [e[2] for e in every], "replica_of": [e[3] for e in every],
               "global_batch_size": job.bridge.train.global_batch_size,
               "saved": got["saved"], "resumed": resumed, "resume_s": resume_s,
               "stock_loads_bitwise": None if stock is None else (
                   set(stock) == set(reps[0]) and all(torch.equal(stock[k], reps[0][k])
                                                      for k in stock))}
        Path(outdir, "bridge_result.json").write_text(json.dumps(out))

    gloo_rank(rank, world, port, outdir, body)


def recipe_worker(rank: int, world: int, port: int, runs: list[tuple[str, str, list[str]]],
                  outdir: str) -> None:
    """One rank of the [2,1] world: every accepted recipe in turn through Bridge's ``train()``;
    rank 0 writes ``nutp_<name>.pt`` (steps, replica 0's parameters, replicas bitwise equal)
    (``benchmarks/recipe_coverage.py``; ``runs``: (name, recipe spec, overrides))."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from types import SimpleNamespace

        import torch.distributed as dist

        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_config import load_bridge_job
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan
        from tests.helpers.hf_offline import offline_hf
        from tests.helpers.parity import _gather_replicas

        offline_hf()
        for name, spec, overrides in runs:
            try:  # (a failure every rank sees alike: recorded, the next recipe runs)
                job = load_bridge_job(spec, None, overrides)
                if job.bridge.model.num_moe_experts:  # megatron's process-global MoE state
                    from tests.helpers.moe_reference import reset_moe_globals

                    reset_moe_globals()
                plan = build_plan(plan_request(job.nutp))
                got = train_rank(job, plan, outdir, seed=job.nutp.train.seed)
            except Exception as e:
                if rank == 0:
                    Path(outdir, f"nutp_{name}.err").write_text(f"{type(e).__name__}: {e}")
                dist.barrier()
                continue
            view = SimpleNamespace(groups=got["groups"], model=got["model"], plan=plan,
                                   model_cfg=job.nutp.model)
            if job.bridge.model.num_moe_experts:  # experts under their global names
                from tests.helpers.moe_jobs import gather_replicas

                reps = gather_replicas(view)
            else:
                reps = _gather_replicas(view)
            if rank == 0:
                assert reps is not None
                equal = all(torch.equal(r[k], reps[0][k]) for r in reps[1:] for k in reps[0])
                torch.save({"steps": got["steps"], "params": reps[0], "equal": equal},
                           Path(outdir, f"nutp_{name}.pt"))
            dist.barrier()

    gloo_rank(rank, world, port, outdir, body)


def resume_worker(rank: int, world: int, port: int, first: list[str], second: list[str],
                  outdir: str) -> None:
    """Two ``nutp-bridge`` runs in this world, one after the other: ``first`` (it saves), then
    ``second`` (it resumes one of ``first``'s checkpoints); rank 0 writes both records."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan

        out = []
        for k, overrides in enumerate((first, second)):
            job = load(overrides)
            plan = build_plan(plan_request(job.nutp))
            got = train_rank(job, plan, outdir, seed=job.nutp.train.seed)
            if rank == 0:  # each run's goodput.json (the second one's replaces it)
                good = Path(outdir, "goodput.json")
                Path(outdir, f"goodput_run{k}.json").write_text(good.read_text())
            out.append({"steps": got["steps"], "saved": got["saved"], "loaded": got["loaded"],
                        "consumed": got["state"].train_state.consumed_train_samples,
                        "consumed_valid": got["state"].train_state.consumed_valid_samples,
                        "evals": got["evals"],
                        "replica_tp": [list(r.tp) for r in plan.replicas]})
        if rank == 0:
            Path(outdir, "resume_result.json").write_text(json.dumps(out))

    gloo_rank(rank, world, port, outdir, body)



def bridge_printed_validation() -> list[str]:
    """The lines Bridge's ``evaluate_and_print_results`` prints (``print_rank_last``: on the
    last rank), recorded by wrapping that function for this process."""
    from megatron.bridge.training import eval as bridge_eval

    printed: list[str] = []
    real = bridge_eval.print_rank_last

    def print_rank_last(message: str) -> None:
        printed.append(message)
        real(message)

    bridge_eval.print_rank_last = print_rank_last
    return printed


def eval_worker(rank: int, world: int, port: int, overrides: list[str], init: str,
                outdir: str) -> None:
    """nutp-bridge's run of ``overrides`` (evaluation on) from the weights of ``init``; every
    rank writes ``eval_rank<r>.json``: its record (steps, evaluations, its evaluation
    micro-batches' unscaled sums) and what Bridge printed on it."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan

        job = load(overrides)
        plan = build_plan(plan_request(job.nutp))
        printed = bridge_printed_validation()
        got = train_rank(job, plan, outdir, seed=job.nutp.train.seed, init_from=init)
        out = {k: got[k] for k in ("steps", "evals", "eval_parts", "replica")}
        out["printed"] = [line for line in printed if "validation loss at" in line]
        out["consumed_valid_samples"] = got["state"].train_state.consumed_valid_samples
        Path(outdir, f"eval_rank{rank}.json").write_text(json.dumps(out))

    gloo_rank(rank, world, port, outdir, body)


def run_worker(rank: int, world: int, port: int, overrides: list[str], outdir: str) -> None:
    """One ``nutp-bridge`` run of ``overrides`` (on top of ``PARITY``) in this world; rank 0
    writes its per-step record to ``run_result.json``."""
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        from nemo_nutp.config import plan_request
        from nemo_nutp.integrations.bridge_run import train_rank
        from nemo_nutp.layout import build_plan

        job = load(overrides)
        plan = build_plan(plan_request(job.nutp))
        got = train_rank(job, plan, outdir, seed=job.nutp.train.seed)
        if rank == 0:
            Path(outdir, "run_result.json").write_text(json.dumps(got["steps"]))

    gloo_rank(rank, world, port, outdir, body)
