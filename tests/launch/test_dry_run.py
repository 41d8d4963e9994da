"""``nutp-train --dry-run`` and the checks done before any process exists (issue #14 items 3, 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_nutp.config import load_config, plan_request
from nemo_nutp.config.recipes import list_recipes
from nemo_nutp.launch.nutp_train import main
from nemo_nutp.layout import build_plan
from tests.helpers.launch import run_train

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name", list_recipes())
def test_every_shipped_recipe_passes_the_dry_run(name: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([f"recipe={name}", f"output.dir={out}", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "TP per stage" in text and "time/micro-batch per stage" in text
    assert "nothing spawned" in text and not out.exists()


def test_dry_run_cli_plans_a_pp4_recipe_without_running_it(tmp_path: Path) -> None:
    """The command line itself (pp=4: the runtime's own pp limit is not applied)."""
    out = tmp_path / "out"
    r = run_train(["recipe=llama3_70b_h100", "--dry-run", f"output.dir={out}"],  # both sides
                  timeout=240)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "8/8/8/8" in r.stdout and " ms" in r.stdout, r.stdout
    assert not out.exists()


def test_per_stage_replicas_size_the_cpu_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    over = ["parallel.pp=2", "nutp.replicas=[[4,3],[4,4]]", "health=none"]
    cfg = load_config(over)
    assert cfg.cluster.name == "cpu_local" and cfg.cluster.num_gpus == 16  # grown from 8
    plan = build_plan(plan_request(cfg))
    assert sorted(r.tp for r in plan.replicas) == [(4, 3), (4, 4)] and plan.world_size == 15
    assert main([*over, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "4/3" in text and "15 ranks" in text
    # an int entry is that degree on every stage; the cluster never shrinks
    assert load_config(["parallel.pp=2", "nutp.replicas=[2,[2,1]]"]).cluster.num_gpus == 16
    assert load_config(["nutp.replicas=[1]"]).cluster.num_gpus == 8


@pytest.mark.parametrize("overrides, key", [
    (["parallel.pp=3"], "parallel.pp=3"),  # does not divide model.num_layers=2
    (["parallel.pp=2", "nutp.replicas=[[4,3,1],[4,4]]"], "nutp.replicas"),
    (["parallel.pp=2", "nutp.replicas=[[4,x],[4,4]]"], "nutp.replicas"),
    (["parallel.sequence_parallel=true", "model.seq_length=16", "nutp.replicas=[4,3]",
      "health=none"], "nutp.replicas"),  # SP: degree 3 does not divide seq_length
    (["recovery.fault.kind=kill", "recovery.fault.rank=7"], "recovery.fault.rank=7"),
    (["cluster=node_pair", "nutp.replicas=[4,4,4,4,4]", "health=none"],
     "cluster.num_gpus=24"),  # not the CPU cluster (16 GPUs): the error names the size to set
    (["cluster.hardware=tpu_v9"], "cluster.hardware='tpu_v9'"),
    (["recipe=llama3_8b_h100", "nutp.replicas=[4,2]"],  # TP2 needs ~97 GiB of 79.6
     "nutp.replicas=[[4], [2]]: replica 1: stage 0 at degree 2 needs"),
])
def test_dry_run_rejects_what_cannot_run(overrides: list[str], key: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*overrides, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert key in err, err
