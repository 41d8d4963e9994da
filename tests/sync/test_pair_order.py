"""NCCL-safe p2p order (issue #22 finding 1), replayed from the sync's own posting code.

For every shipped layout — the default config (tiny, one GPU down: TP4+TP3), every model of
``configs/model`` at TP top+(top-1) and TP8+TP6, every recipe with one GPU down — and both sync
layouts, every rank of every replica stage that reshards runs the engine's step and the
distributed optimizer's moves with a recording p2p stand-in (``pair_replay``); both sides of
every rank pair must post matching operations head to head (NCCL's in-order, blocking pair
semantics). The posting code before this fix (0e4511c) fails here: with ``base`` both sides of
a pair that reshards in both directions posted their receive first.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from nemo_nutp.config import load_config
from nemo_nutp.config.derived import plan_request
from nemo_nutp.config.recipes import list_recipes, load_recipe
from nemo_nutp.layout import ClusterSpec, ParallelSpec, Plan, PlanRequest, build_plan
from tests.helpers.pair_replay import (
    Recorder,
    mismatches,
    p2p_ranks,
    replay_ranks,
    replay_ring,
    stage_ranks,
)

MODELS = sorted((Path(__file__).resolve().parents[2] / "configs" / "model").glob("*.yaml"))
LAYOUTS = ("base", "refine")
LAYERS = 2  # the messages and buckets of a stage repeat per layer; 2 keep the seams between


def _check(plan: Plan, bucket_size: int, *, layers: int | None = LAYERS) -> int:
    """Replays every resharding replica stage; returns how many ops were checked."""
    ops: dict[int, list] = {}
    for ranks in p2p_ranks(plan):
        ops.update(replay_ranks(plan, ranks, bucket_size=bucket_size, layers=layers))
    bad = mismatches(ops)
    assert not bad, "p2p orders that hang under NCCL:\n" + "\n".join(bad[:10])
    return sum(len(v) for v in ops.values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_config(layout: str) -> None:
    cfg = load_config([f"parallel.sync_layout={layout}"])
    plan = build_plan(plan_request(cfg))
    assert [r.tp for r in plan.replicas] == [(4,), (3,)]
    for bucket_size in (cfg.sync.bucket_size, 1000, 1):  # one message, several, one per piece
        n = _check(plan, bucket_size, layers=None)
        assert (n > 0) == (layout == "base")  # refine moves nothing


def _model_plans(path: Path, layout: str) -> list[Plan]:
    from nemo_nutp.config import ModelConfig
    from nemo_nutp.layout.units import max_degree

    model = ModelConfig(**yaml.safe_load(path.read_text()))
    top = min(8, max_degree(model))
    plans = []
    for low in sorted({top - 1, top - 2} - {0}):
        plans.append(build_plan(PlanRequest(
            cluster=ClusterSpec(num_gpus=2 * top, domain_size=top, gpus_per_node=top),
            model=model, parallel=ParallelSpec(tp_base=top, sync_layout=layout),
            replicas=(top, low), global_batch=64)))
    return plans


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", MODELS, ids=[p.stem for p in MODELS])
def test_every_model(path: Path, layout: str) -> None:
    t0 = time.thread_time()  # this thread's CPU time: the replay's work, not the machine's load
    for plan in _model_plans(path, layout):
        n = _check(plan, 40_000_000)
        tps = [r.tp[0] for r in plan.replicas]
        if layout == "refine" or tps[0] % tps[1] == 0:  # nothing to move
            assert n == 0, tps
        else:
            assert n > 0, tps
        _check(plan, 4_000_000)  # several messages per pair
    assert time.thread_time() - t0 < 60


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", [n for n in list_recipes() if n != "base_pretrain"])
def test_every_recipe_one_gpu_down(name: str, layout: str) -> None:
    cfg = load_recipe(name, [f"parallel.sync_layout={layout}", "health.failed_gpus=[7]"])
    plan = build_plan(plan_request(cfg))
    assert any(t < cfg.parallel.tp_base for r in plan.replicas for t in r.tp)
    n = _check(plan, cfg.sync.bucket_size)
    assert (n > 0) == (layout == "base")


def _check_ring(plan: Plan, bucket_size: int) -> int:
    ops: dict[int, list] = {}
    for ranks in stage_ranks(plan):
        ops.update(replay_ring(plan, ranks, bucket_size=bucket_size, layers=LAYERS))
    bad = mismatches(ops)
    assert not bad, "redundancy ring orders that hang under NCCL:\n" + "\n".join(bad[:10])
    return sum(len(v) for v in ops.values())


@pytest.mark.parametrize("overrides", [
    [], ["parallel.sequence_parallel=true"], ["parallel.pp=2", "parallel.tp_base=2"],
    ["health.failed_gpus=[]", "cluster.num_gpus=6", "cluster.domain_size=2",
     "cluster.gpus_per_node=2", "parallel.tp_base=2", "health.failed_gpus=[5]"]],
    ids=["default", "sp", "pp2", "tp2x3"])
def test_zero_redundancy_ring(overrides: list[str]) -> None:
    """The distributed optimizer's redundancy ring (``recovery.live_redundancy``: every
    bucket's reduced chunk to the next member of its group, each step), every rank of every
    stage: matched head to head; then one small bucket size (many buckets per group)."""
    cfg = load_config(overrides)
    plan = build_plan(plan_request(cfg))
    for bucket_size in (cfg.sync.bucket_size, 500):
        n = _check_ring(plan, bucket_size)
        assert n > 0


def test_zero_redundancy_ring_70b_recipe() -> None:
    """A shipped recipe's layout, one GPU down (the other recipes' rings are the same code
    over more ranks: 8-30 s each)."""
    cfg = load_recipe("llama3_70b_h100", ["health.failed_gpus=[7]"])
    assert _check_ring(build_plan(plan_request(cfg)), cfg.sync.bucket_size) > 0


def test_replay_catches_a_crossed_pair() -> None:
    """The check itself: two ranks that both receive first are reported; matched ones not."""
    rec = Recorder()
    for rank, first, second in ((0, "recv", "send"), (1, "recv", "send")):
        rec.ops[rank] += [(1 - rank, first, 8), (1 - rank, second, 8)]
    assert mismatches(dict(rec.ops)) == [
        "ranks 0<->1 op 0: 0 posts ('recv', 8), 1 posts ('recv', 8)"]
    assert mismatches({0: [(1, "send", 8), (1, "recv", 4)],
                       1: [(0, "recv", 8), (0, "send", 4)]}) == []
    assert mismatches({0: [(1, "send", 8)], 1: [(0, "recv", 4)]})  # sizes differ
    assert mismatches({0: [(1, "send", 8)], 1: []})  # a send nobody receives
