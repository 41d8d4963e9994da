"""``nutp sbatch``: the rendered script is valid bash and carries exactly the plan's rank order.

No process runs beyond ``bash -n``: the rank table and the trainer command are parsed back from
the script text and compared with the plan.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from nemo_nutp.config import load_config, plan_request
from nemo_nutp.config.recipes import RECIPES_DIR, load_job, split_recipe
from nemo_nutp.config.schema import CONFIG_DIR
from nemo_nutp.launch.nutp_cli import main
from nemo_nutp.launch.slurm import SbatchOptions, node_table, render_sbatch
from nemo_nutp.layout import build_plan

BASH = shutil.which("bash")

JOBS = {
    "cpu_local_one_gpu": ["health=one_gpu"],
    "node_pair_tp8": ["cluster=node_pair", "parallel.tp_base=8", "model=llama3_8b",
                      "health=one_gpu", "train.global_batch_size=64",
                      "train.micro_batch_size=1"],
    "dgx_report_pp2": ["recipe=llama3_70b_h100", "health=report", "parallel.pp=2"],
    "nvl72_failed": ["recipe=llama3_8b_gb200", "health.failed_gpus=[5,77,300,301]"],
    # drop: the replica on node 0 goes, so node 0 is not allocated (node ids are compacted).
    "drop_frees_node": ["cluster=node_pair", "parallel.tp_base=8", "model=llama3_8b",
                        "health=one_gpu", "nutp.policy=drop"],
}


def _plan(overrides: list[str]):
    cfg = load_job(overrides)
    return build_plan(plan_request(cfg))


def _render(overrides: list[str], **opts) -> str:
    recipe, rest = split_recipe(overrides)
    return render_sbatch(_plan(overrides), SbatchOptions(**opts), overrides=rest, recipe=recipe)


def _table(text: str) -> dict[int, list[int]]:
    rows = re.findall(r'^export NUTP_NODE_RANKS_(\d+)="([-\d ]+)"', text, re.M)
    return {int(k): [int(x) for x in v.split()] for k, v in rows}


def _sbatch(text: str, key: str) -> str:
    return re.search(rf"^#SBATCH --{key}=(\S+)$", text, re.M).group(1)


def _bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    res = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(BASH is None, reason="bash not installed")
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
@pytest.mark.parametrize("job", sorted(JOBS))
def test_script_is_valid_bash_and_carries_the_plan(job: str, launcher: str,
                                                   tmp_path: Path) -> None:
    overrides = JOBS[job]
    plan = _plan(overrides)
    text = _render(overrides, launcher=launcher, partition="p", account="a", image="img:1",
                   mounts=("/data:/data",))
    _bash_n(text, tmp_path)

    gpn = plan.request.cluster.gpus_per_node
    nodes = sorted({g // gpn for g in plan.rank_to_gpu})
    expected = [(nodes.index(g // gpn), g % gpn) for g in plan.rank_to_gpu]
    table = _table(text)
    assert sorted(table) == list(range(len(nodes)))
    emitted = {rank: (k, gpu) for k, row in table.items() for gpu, rank in enumerate(row)
               if rank >= 0}
    assert [emitted[r] for r in range(len(emitted))] == expected
    assert all(len(row) == gpn for row in table.values())
    assert node_table(plan).rank_slots() == expected

    assert int(_sbatch(text, "nodes")) == len(nodes)
    assert int(_sbatch(text, "gpus-per-node")) == gpn
    assert int(_sbatch(text, "ntasks-per-node")) == (gpn if launcher == "srun" else 1)
    assert f"export NUTP_WORLD_SIZE={plan.world_size}\n" in text
    assert f"NUTP_RANK0_NODE={expected[0][0]}\n" in text
    assert ("torchrun --nnodes" in text) == (launcher == "torchrun")
    assert '--container-image="$NUTP_IMAGE"' in text and "--container-mounts" in text


def test_node_count_is_ceil_of_gpus_in_use_when_nodes_are_filled() -> None:
    plan = _plan(JOBS["dgx_report_pp2"])
    gpn = plan.request.cluster.gpus_per_node
    assert len(node_table(plan).nodes) == -(-plan.world_size // gpn)
    assert len(node_table(_plan(JOBS["drop_frees_node"])).nodes) == 1


@pytest.mark.parametrize("job", sorted(JOBS))
def test_trainer_command_rebuilds_the_same_plan(job: str, monkeypatch) -> None:
    """The nutp-train words in the script, loaded the way nutp-train loads them, plan the same."""
    overrides = JOBS[job]
    expected = _plan(overrides).rank_to_gpu
    text = _render(overrides, repo="/opt/x")
    line = re.search(r"^NUTP_TRAIN=\((.*)\)$", text, re.M).group(1)
    words = shlex.split(line.replace("${NUTP_REPO}/configs", str(CONFIG_DIR)))
    assert words[0] == "nutp-train"
    args, config_name = words[1:], "config"
    if args[:1] == ["--config-name"]:
        config_name, args = args[1], args[2:]
    if 'export NUTP_CONFIG_DIR="${NUTP_REPO}/recipes"' in text:
        monkeypatch.setenv("NUTP_CONFIG_DIR", str(RECIPES_DIR))
    cfg = load_config(args, config_name=config_name)
    assert build_plan(plan_request(cfg)).rank_to_gpu == expected


BRIDGE_ARGV = ["--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config",
               "--config-file", "/shared/my job/overrides.yaml",
               "--output-dir", "/shared/run it's $HOME `id`", "model.tensor_model_parallel_size=2",
               'logger.wandb_exp_name="a b"; rm -rf /', "recovery.enabled=true"]


def _array(text: str, name: str, tmp_path: Path) -> list[str]:
    """The words of the script's bash array ``name``, as bash reads them."""
    line = re.search(rf"^{name}=\(.*\)$", text, re.M).group(0)
    res = subprocess.run([BASH, "-c", f'{line}\nprintf "%s\\0" "${{{name}[@]}}"'],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return res.stdout.split("\0")[:-1]


@pytest.mark.skipif(BASH is None, reason="bash not installed")
@pytest.mark.parametrize("mode", ["none", "restart", "live"])
def test_bridge_command_carries_the_job_verbatim(mode: str, tmp_path: Path) -> None:
    """``nutp-bridge sbatch``'s script (``bridge_command``): the same script as ``nutp
    sbatch``'s, whose ranks (plain srun tasks, the srun loop's recovery workers) run
    ``nutp-bridge`` and whose live control process is ``nutp-bridge control``, with the job's
    arguments word for word (a path with spaces, quotes, ``$`` and backquotes; an override with
    a quote and a ``;``); the node agents are the same (they start what the control process
    sends them: tests/recovery/test_hosts.py). Rendering needs no Bridge: the fast check; the
    end-to-end ``nutp-bridge sbatch`` is tests/launch/test_bridge_slurm.py (Python 3.12)."""
    from nemo_nutp.launch.slurm import bridge_command

    over = ["cluster.num_gpus=8", "cluster.gpus_per_node=4", "health.failed_gpus=[7]",
            "checkpoint.interval=2",
            *({"none": [], "restart": ["recovery.enabled=true"],
               "live": ["recovery.enabled=true", "recovery.mode=live"]}[mode])]
    cfg = load_job(over)
    text = render_sbatch(build_plan(plan_request(cfg)), SbatchOptions(image="img"),
                         command=bridge_command(BRIDGE_ARGV),
                         recovery=cfg.recovery if cfg.recovery.enabled else None)
    _bash_n(text, tmp_path)
    header = text.splitlines()[1:3]
    assert header[0].startswith("# Generated by `nutp-bridge sbatch`;"), header
    assert header[1].startswith("#   nutp-bridge sbatch --recipe megatron.bridge"), header
    assert "nutp-train" not in text and "nemo_nutp.launch.control" not in text
    if mode == "live":
        assert _array(text, "NUTP_LIVE", tmp_path) == ["nutp-bridge", "control", *BRIDGE_ARGV]
        assert "NUTP_TRAIN=" not in text and "python -m nemo_nutp.recovery.agent" in text
        return
    assert _array(text, "NUTP_TRAIN", tmp_path) == ["nutp-bridge", *BRIDGE_ARGV]
    assert ("for attempt in" in text) == (mode == "restart")
    assert ("nutp_task" in text) == (mode == "none")


def test_bridge_command_refuses_a_control_character() -> None:
    from nemo_nutp.launch.slurm import bridge_command

    with pytest.raises(ValueError, match=r"^nutp-bridge argument 3 'a\\nb': no newline"):
        bridge_command(["--recipe", "m:f", "a\nb"])


def test_placeholders_when_cluster_settings_are_missing(tmp_path: Path) -> None:
    text = _render(["health=none"])
    assert _sbatch(text, "partition") == "<partition>"
    assert _sbatch(text, "account") == "<account>"
    assert 'NUTP_IMAGE="${NUTP_IMAGE:-<image>}"' in text
    assert "--nodelist" not in text
    for leak in ("/home/", "/Users/", "/work/", "/lustre", str(Path.home())):
        assert leak not in text


@pytest.mark.parametrize(("field", "value"), [
    ("launcher", "mpirun"), ("time", "four hours"), ("partition", "a b"), ("image", "x;rm"),
    ("mounts", ("/data",)), ("master_port", 80),
])
def test_bad_options_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^{field}="):
        SbatchOptions(**{field: value})


def test_cli_writes_atomically(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "job.sbatch"
    rc = main(["sbatch", "recipe=llama3_8b_h100", "cluster=node_pair", "health=one_gpu",
               "--partition", "P", "--account", "A", "--image", "nvcr.io#org/img:1",
               "--mounts", "/data:/data,/results:/results", "--time", "01:00:00",
               "--out", str(out)])
    assert rc == 0
    assert out.stat().st_mode & 0o111
    assert [p.name for p in out.parent.iterdir()] == ["job.sbatch"]  # no temp file left
    text = out.read_text()
    assert _sbatch(text, "partition") == "P" and _sbatch(text, "time") == "01:00:00"
    assert "/data:/data,/results:/results" in text
    assert "--config-name llama3_8b_h100" in text
    assert main(["sbatch", "+train.bogus=1", "--out", str(out)]) == 2
    assert out.read_text() == text  # a failed render leaves the old script alone


def test_requeue_flag(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    for extra in ([], ["recovery.enabled=true", "checkpoint.interval=2"],
                  ["recovery.enabled=true", "recovery.mode=live",
                   "checkpoint.interval=2"]):
        assert main(["sbatch", *extra, "--out", str(out)]) == 0
        assert "#SBATCH --requeue" not in out.read_text()
        assert "--max-requeues" not in out.read_text()
        assert main(["sbatch", *extra, "--requeue", "--out", str(out)]) == 0
        text = out.read_text()
        assert re.findall(r"^#SBATCH --requeue$", text, re.M) == ["#SBATCH --requeue"]
        # live mode: the agents left resubmit the job when the batch host is lost
        assert ("--timeout=300 --max-requeues=3 &" in text) == ("recovery.mode=live" in extra)


def test_plan_accepts_recipe(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--recipe", "llama3_8b_h100", "cluster=node_pair", "--json",
                 str(out)]) == 0
    assert out.exists()


RECOVERY = ["cluster=node_pair", "parallel.tp_base=8", "model=llama3_8b", "health=one_gpu",
            "train.global_batch_size=64", "train.micro_batch_size=1", "recovery.enabled=true",
            "checkpoint.interval=50", "recovery.heartbeat_timeout_s=90"]


@pytest.mark.skipif(BASH is None, reason="bash not installed")
@pytest.mark.parametrize("launcher", ["srun", "torchrun", "ft_launcher"])
def test_recovery_script_runs_a_worker_per_gpu_slot_under_restarts(launcher: str,
                                                                   tmp_path: Path) -> None:
    cfg = load_job(RECOVERY)
    plan = build_plan(plan_request(cfg))
    text = render_sbatch(plan, SbatchOptions(launcher=launcher, image="img:1"),
                         overrides=RECOVERY, recovery=cfg.recovery)
    _bash_n(text, tmp_path)
    c = cfg.cluster
    assert plan.world_size < c.num_gpus  # the failed GPU's slot still gets a worker
    assert int(_sbatch(text, "nodes")) == c.num_gpus // c.gpus_per_node
    assert f"export NUTP_WORLD_SIZE={c.num_gpus}\n" in text
    assert "NUTP_NODE_RANKS_" not in text  # no static rank table: each attempt re-plans
    restarts = cfg.recovery.max_restarts
    if launcher == "srun":
        assert int(_sbatch(text, "ntasks-per-node")) == c.gpus_per_node
        assert f"for attempt in $(seq 0 {restarts}); do" in text
        assert "LOCAL_RANK=$SLURM_LOCALID" in text and "NUTP_ATTEMPT=$1" in text
        # srun's --kill-on-bad-exit SIGKILLs (no exit records): workers abort in-band instead.
        assert "--kill-on-bad-exit=0" in text and "--wait=" in text
    else:
        assert int(_sbatch(text, "ntasks-per-node")) == 1
        assert f"{launcher} --nnodes" in text and f"--max-restarts={restarts}" in text
    if launcher == "ft_launcher":  # our watchdog (which names the hung rank) must act first
        hb = float(re.search(r"--ft-rank-heartbeat-timeout=(\S+)", text).group(1))
        init = float(re.search(r"--ft-initial-rank-heartbeat-timeout=(\S+)", text).group(1))
        assert hb > cfg.recovery.heartbeat_timeout_s and init > cfg.recovery.startup_timeout_s


def test_ft_launcher_needs_recovery() -> None:
    with pytest.raises(ValueError, match=r"ft_launcher.*recovery.enabled=true"):
        _render(JOBS["cpu_local_one_gpu"], launcher="ft_launcher")
