"""The planner's GPU memory model (``layout.memory``) against independent numbers: Meta's
published Llama 3 parameter counts, and Korthikanti et al.'s closed-form activation memory;
the planner never plans a degree that does not fit, and an explicit one is an error naming the
fields to change; the shipped H100 recipes fit 80 GB in bf16 (the dry run prints it)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nemo_nutp.config.derived import memory_spec, plan_request
from nemo_nutp.config.recipes import load_recipe
from nemo_nutp.layout import ClusterSpec, HealthReport, ModelDims, ParallelSpec, PlanRequest
from nemo_nutp.layout.memory import (
    GIB,
    MemorySpec,
    layer_activation_bytes,
    rank_params,
    stage_activation_bytes,
    stage_memory,
    why_not,
)
from nemo_nutp.layout.plan import build_plan

LLAMA3_8B = ModelDims(num_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256,
                      seq_length=8192, gated_linear_unit=True)
LLAMA3_70B = dataclasses.replace(LLAMA3_8B, num_layers=80, hidden_size=8192,
                                 num_attention_heads=64, ffn_hidden_size=28672)


def test_parameter_counts_match_the_published_llama3_sizes() -> None:
    # Hugging Face meta-llama/Meta-Llama-3-{8B,70B} safetensors totals (8.03B / 70.6B).
    assert rank_params(LLAMA3_8B, 1, stage=0, pp=1) == 8_030_261_248
    assert rank_params(LLAMA3_70B, 1, stage=0, pp=1) == 70_553_706_496
    # sharded: TP8 x PP4 ranks together hold the model (+ replicated norms per rank)
    per_stage = [rank_params(LLAMA3_70B, 1, stage=s, pp=4) for s in range(4)]
    assert sum(per_stage) == 70_553_706_496


def _korthikanti(s: int, b: int, h: int, a: int, t: int, *, sp: bool, selective: bool
                 ) -> float:
    """Per-layer activation bytes, Korthikanti et al. 2022, eqs. (1)-(5): GPT layer (4h MLP,
    MHA, dropout, half precision)."""
    attn = 0.0 if selective else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + attn)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("selective", [False, True])
def test_activations_match_korthikanti_closed_form(t: int, sp: bool, selective: bool) -> None:
    gpt = ModelDims(num_layers=4, hidden_size=2048, num_attention_heads=16, num_query_groups=16,
                    ffn_hidden_size=4 * 2048, vocab_size=51200, seq_length=2048,
                    gated_linear_unit=False)
    spec = MemorySpec(gpu_memory_gib=80, micro_batch_size=2, sequence_parallel=sp,
                      flash_attention=False, dropout=True,
                      recompute_granularity="selective" if selective else None)
    got = layer_activation_bytes(gpt, t, spec)
    want = _korthikanti(2048, 2, 2048, 16, t, sp=sp, selective=selective)
    assert got == pytest.approx(want, rel=1e-12)
    # full recompute keeps only each layer's input (2sbh; /t under SP) + one layer in backward
    full = dataclasses.replace(spec, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)
    mid = stage_activation_bytes(gpt, t, full, stage=0, pp=2)  # no logits on stage 0
    layer_in = 2 * 2048 * 2 * 2048 / (t if sp else 1)
    ref = dataclasses.replace(spec, recompute_granularity=None)
    assert mid == pytest.approx(2 * (2 * layer_in) + layer_activation_bytes(gpt, t, ref))


def test_flash_attention_drops_the_quadratic_term() -> None:
    spec = MemorySpec(gpu_memory_gib=80)
    local = dataclasses.replace(spec, flash_attention=False)
    flash = layer_activation_bytes(LLAMA3_8B, 4, spec)
    dense = layer_activation_bytes(LLAMA3_8B, 4, local)
    # 8 heads per rank x 8192^2 bf16 probabilities: 1 GiB per layer more
    assert dense - flash == pytest.approx(8 * 8192 ** 2 * 2 - 4 * 8 * 8192)
    assert flash < 0.5 * GIB


def _req(degraded_healthy: int | None, *, replicas: tuple[int, ...] | None = None,
         tp_base: int = 4, **mem: object) -> PlanRequest:
    failed = () if degraded_healthy is None else tuple(range(tp_base - degraded_healthy))
    spec = MemorySpec(gpu_memory_gib=79.6, replicas=4, **mem)  # type: ignore[arg-type]
    return PlanRequest(cluster=ClusterSpec(num_gpus=16, domain_size=8),
                       model=LLAMA3_8B, parallel=ParallelSpec(tp_base=tp_base),
                       health=HealthReport(failed), replicas=replicas, global_batch=16,
                       memory=spec)


def test_planner_never_plans_a_degree_that_does_not_fit() -> None:
    fits = {t: stage_memory(LLAMA3_8B, t, _req(None).memory, stage=0, pp=1).fits  # type: ignore
            for t in (1, 2, 3, 4)}
    assert fits == {1: False, 2: False, 3: True, 4: True}, fits
    assert sorted(r.tp[0] for r in build_plan(_req(3)).replicas) == [3, 4, 4, 4]
    plan = build_plan(_req(2))  # a TP2 replica would not fit: dropped, not planned
    assert sorted(r.tp[0] for r in plan.replicas) == [4, 4, 4]
    assert plan.dropped_replicas == 1
    no_memory = dataclasses.replace(_req(2), memory=None)  # without the model it would be
    assert sorted(r.tp[0] for r in build_plan(no_memory).replicas) == [2, 4, 4, 4]


def test_explicit_degrees_that_do_not_fit_name_the_fields() -> None:
    with pytest.raises(ValueError, match=r"nutp\.replicas=\[\[4\], \[2\]\]: replica 1: "
                       r"stage 0 at degree 2 .*GiB.*hardware\.gpu_memory_gib=79\.6"
                       r".*train\.distributed_optimizer"):
        build_plan(_req(None, replicas=(4, 2)))
    with pytest.raises(ValueError, match=r"parallel\.tp_base=2: stage 0 at degree 2 needs .*"
                       r"model\.recompute_granularity=full"):
        build_plan(_req(None, tp_base=2))
    # what the message suggests works: the distributed optimizer makes TP2 fit
    plan = build_plan(_req(None, replicas=(4, 2), distributed_optimizer=True))
    assert [r.tp[0] for r in plan.replicas] == [4, 2]


def test_the_remedies_named_are_the_ones_not_already_taken() -> None:
    """A layout that does not fit names only what would still help: not the distributed
    optimizer when it is on (on one replica it has nothing to shard over: more GPUs), not full
    recompute or sequence parallelism when they are on."""
    spec = dataclasses.replace(_req(None).memory, gpu_memory_gib=1.0)
    text = why_not(LLAMA3_8B, 8, spec, pp=1)
    assert "train.distributed_optimizer=true" in text and "cluster.num_gpus" not in text
    zero1 = dataclasses.replace(spec, distributed_optimizer=True, replicas=1,
                                recompute_granularity="full", sequence_parallel=True)
    text = why_not(LLAMA3_8B, 8, zero1, pp=1)
    for taken in ("train.distributed_optimizer", "recompute_granularity", "sequence_parallel"):
        assert taken not in text, text
    assert text.endswith("cluster.num_gpus (one replica: nothing to shard the optimizer state "
                         "over)"), text


def test_live_redundancy_doubles_the_distributed_optimizer_state() -> None:
    """``recovery.live_redundancy``: each slice twice; fp32 models keep masters too."""
    spec = _req(None).memory
    assert spec is not None
    for pb in (2, 4):
        zero = dataclasses.replace(spec, param_bytes=pb, distributed_optimizer=True,
                                   replicas=16)
        red = dataclasses.replace(zero, zero_redundancy=True)
        a = stage_memory(_req(None).model, 8, zero, stage=0, pp=1)
        b = stage_memory(_req(None).model, 8, red, stage=0, pp=1)
        assert b.optimizer == a.optimizer * (2 if pb == 2 else 3)  # fp32: + 4 B masters
        assert b.weights == a.weights and b.grads == a.grads


@pytest.mark.parametrize("name", ["llama3_8b_h100", "llama3_70b_h100"])
def test_h100_recipes_fit_80gb_in_bf16(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_recipe(name)
    assert cfg.train.precision == "bf16"
    spec = memory_spec(cfg)
    assert spec is not None and spec.gpu_memory_gib <= 80 and spec.param_bytes == 2
    plan = build_plan(plan_request(cfg))
    for s in range(plan.pp):
        for t in {r.tp[s] for r in plan.replicas}:
            m = stage_memory(cfg.model, t, spec, stage=s, pp=plan.pp)
            assert m.fits and m.total < 80e9, (s, t, m.total / GIB)
    from nemo_nutp.launch.nutp_train import main

    assert main([f"recipe={name}", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "Memory per GPU, GiB (of 79.6): bf16" in text, text
    rows = re.findall(r"│\s+(\d)\s+│\s+(\d)\s+│.*│\s+([\d.]+)\s+│\s+(yes|NO)\s+│", text)
    assert len(rows) == plan.pp and all(r[3] == "yes" and float(r[2]) < 74.5 for r in rows), rows
