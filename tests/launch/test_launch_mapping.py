"""Plain torchrun/srun (no recovery): the launcher rank must sit on the GPU the plan gives it
(issue #22 finding 9), else a one-line error before any process group exists."""

from __future__ import annotations

import pytest

from nemo_nutp.config import load_config
from nemo_nutp.config.derived import plan_request
from nemo_nutp.launch.nutp_train import check_launch
from nemo_nutp.layout import build_plan


def _plan(overrides: list[str]) -> tuple[object, object]:
    cfg = load_config(overrides)
    return cfg, build_plan(plan_request(cfg))


def test_launcher_rank_must_be_on_its_planned_gpu() -> None:
    cfg, plan = _plan([])  # GPU 7 down: TP4 on GPUs 0-3, TP3 on 4-6
    world = plan.world_size  # type: ignore[attr-defined]
    for r in range(world):  # one node: worker r drives GPU r
        check_launch(cfg, plan, (r, world, r), {})
    cfg, plan = _plan(["health.failed_gpus=[2]"])  # the degraded domain is planned last
    gpus = plan.rank_to_gpu  # type: ignore[attr-defined]
    bad = [r for r in range(world) if gpus[r] != r]
    assert bad, gpus
    for r in range(world):
        if r in bad:
            with pytest.raises(ValueError, match=f"RANK={r}: this worker drives GPU slot {r} "
                               f"but the plan puts rank {r} on GPU {gpus[r]}"):
                check_launch(cfg, plan, (r, world, r), {})
        else:
            check_launch(cfg, plan, (r, world, r), {})


def test_world_and_node_index() -> None:
    cfg, plan = _plan([])
    world = plan.world_size  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=f"WORLD_SIZE=8: the plan has {world} ranks"):
        check_launch(cfg, plan, (0, 8, 0), {})
    with pytest.raises(ValueError, match="drives GPU slot 8 but the plan puts rank 0 on GPU 0"):
        check_launch(cfg, plan, (0, world, 0), {"NUTP_NODE_INDEX": "1"})
