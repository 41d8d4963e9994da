"""``nutp sbatch``: render a Slurm batch script (pyxis/enroot container) for a NUTP job.

The script only sets resources, container and mounts, then starts ``nutp-train`` with the same
overrides the plan was made from -- or, rendered by ``nutp-bridge sbatch``
(``launch/bridge_cli.py``), ``nutp-bridge`` with the same Bridge recipe, config file and
overrides (``JobCommand``: the one difference between the two scripts). What it guarantees:

* ``--nodes`` = the nodes holding at least one GPU of the plan (= ceil(GPUs in use / GPUs per
  node) whenever the plan fills nodes; a node the plan does not touch is not allocated).
* The plan's rank order is honoured: the script carries, per Slurm node id, the plan rank of every
  local GPU (``NUTP_NODE_RANKS_<node>``, -1 = failed or idle). Slurm starts one task per GPU slot
  in its usual block order; a small wrapper (``nutp_task``) looks up the slot's plan rank and sets
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``CUDA_VISIBLE_DEVICES``/``MASTER_ADDR`` before it execs
  the trainer, so every TP group lands in the scale-up domain the planner chose. Unused slots
  exit 0.
* Slurm node id ``k`` is the k-th host of ``scontrol show hostnames $SLURM_JOB_NODELIST`` and is
  taken to be the k-th node of the plan that holds a rank (``--nodelist`` pins the hosts when GPU
  ids from a health report must match physical nodes).

Not guaranteed: that ``nutp-train`` (``nutp-bridge``) in the image plans the same way; run the
same code version.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.env import CONFIG_DIR
from ..config.recipes import searchpath_override
from ..layout.plan import Plan
from ..layout.serialize import atomic_path

LAUNCHERS = ("srun", "torchrun", "ft_launcher")
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_WORD = re.compile(r"^[^\s\"'`$\\;|&<>]+$")


def _check_word(name: str, value: str | None) -> None:
    if value is not None and not _WORD.match(value):
        raise ValueError(f"{name}={value!r}: no whitespace, quotes or shell characters allowed")


@dataclass(frozen=True)
class SbatchOptions:
    """Cluster-side settings of the batch script (none of them is committed anywhere)."""

    partition: str | None = None
    """Slurm partition; a ``<partition>`` placeholder if unset."""
    account: str | None = None
    """Slurm account; an ``<account>`` placeholder if unset."""
    image: str | None = None
    """Container image for pyxis (``nvcr.io#org/img:tag`` or a .sqsh path); placeholder if unset."""
    mounts: tuple[str, ...] = ()
    """Container mounts ``SRC:DST[:FLAGS]``."""
    time: str = "04:00:00"
    """Wall-clock limit (Slurm syntax)."""
    job_name: str = "nutp"
    """Slurm job name."""
    launcher: str = "srun"
    """'srun' (one task per GPU), 'torchrun' (one task per node, torchrun spawns the GPUs) or
    'ft_launcher' (nvidia-resiliency-ext's torchrun; needs ``recovery.enabled=true``)."""
    master_port: int = 29500
    """Port of rank 0's torch.distributed store (torchrun's rendezvous uses the next one)."""
    nodelist: str | None = None
    """Optional ``--nodelist`` pinning the hosts in plan node order."""
    repo: str = "/opt/nemo_nutp"
    """Where the Dockerfile installed nemo_nutp inside the image (configs/ and recipes/)."""
    requeue: bool = False
    """``#SBATCH --requeue``: Slurm may requeue the job (node failure, preemption); the
    requeued job starts the script again from the top. Live mode: when the batch host is lost,
    a node agent left resubmits the script as a new job (``recovery/agent.py: resubmit``)."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: must be one of {LAUNCHERS}")
        if not _TIME.match(self.time):
            raise ValueError(f"time={self.time!r}: expected Slurm time, e.g. 04:00:00")
        if not 1024 <= self.master_port < 65535:
            raise ValueError(f"master_port={self.master_port}: must be in 1024..65534")
        for name in ("partition", "account", "image", "job_name", "nodelist", "repo"):
            _check_word(name, getattr(self, name))
        for m in self.mounts:
            _check_word("mounts", m)
            if m.count(":") not in (1, 2) or "," in m:
                raise ValueError(f"mounts={m!r}: expected SRC:DST[:FLAGS]")


@dataclass(frozen=True)
class NodeTable:
    """Plan rank of every GPU slot of the allocation, in Slurm node id order."""

    nodes: tuple[int, ...]
    """Cluster node index of each allocated node (Slurm node id = position)."""
    rows: tuple[tuple[int, ...], ...]
    """Per allocated node: plan rank of local GPU 0..gpus_per_node-1, -1 if unused."""
    gpus_per_node: int

    def rank_slots(self) -> list[tuple[int, int]]:
        """rank -> (Slurm node id, local GPU): the plan's ``rank_to_gpu`` on the allocation."""
        out: dict[int, tuple[int, int]] = {}
        for k, row in enumerate(self.rows):
            for gpu, rank in enumerate(row):
                if rank >= 0:
                    out[rank] = (k, gpu)
        return [out[r] for r in range(len(out))]


def node_table(plan: Plan) -> NodeTable:
    gpn = plan.request.cluster.gpus_per_node
    nodes = sorted({g // gpn for g in plan.rank_to_gpu})
    slot = {n: k for k, n in enumerate(nodes)}
    rows = [[-1] * gpn for _ in nodes]
    for rank, g in enumerate(plan.rank_to_gpu):
        rows[slot[g // gpn]][g % gpn] = rank
    return NodeTable(nodes=tuple(nodes), rows=tuple(tuple(r) for r in rows), gpus_per_node=gpn)


@dataclass(frozen=True)
class JobCommand:
    """What the script starts, as bash words (each quoted once): the only part of the script
    that differs between ``nutp sbatch`` and ``nutp-bridge sbatch``."""

    rank: tuple[str, ...]
    """One rank or recovery worker: ``nutp-train <overrides>`` or ``nutp-bridge <args>``."""
    control: tuple[str, ...]
    """The live control process (the script appends ``--listen``/``--address``); it tells the
    node agents what a rank runs (``recovery.world.RankEntry``)."""
    shown: str
    """The command that rendered the script, for its header (one line)."""
    extra: str = ""
    """Script lines before the launch (e.g. ``recipes/`` as Hydra's primary config dir)."""


def nutp_command(overrides: list[str], *, config_name: str = "config",
                 recipe: str | None = None) -> JobCommand:
    """``nutp sbatch``'s: ``nutp-train`` ranks, ``python -m nemo_nutp.launch.control``."""
    train, extra = train_command(overrides, config_name=config_name, recipe=recipe)
    shown = " ".join(["nutp sbatch", *([f"recipe={recipe}"] if recipe else []),
                      *([f"--config-name {config_name}"] if config_name != "config" else []),
                      *(shlex.quote(o) for o in overrides)])
    return JobCommand(tuple(train), ("python", "-m", "nemo_nutp.launch.control", *train[1:]),
                      shown, extra)


_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def bridge_command(argv: list[str]) -> JobCommand:
    """``nutp-bridge sbatch``'s: ``argv`` (``--recipe``, ``--config-file``, ``--output-dir``
    and the overrides, as ``nutp-bridge`` takes them) carried verbatim, each word quoted once,
    to ``nutp-bridge`` (every rank or recovery worker) and ``nutp-bridge control`` (the live
    control process). A word with a newline or another control character is refused (one
    line naming it): it would end the header's comment line."""
    for i, word in enumerate(argv):
        if _CONTROL_CHARS.search(word):
            raise ValueError(f"nutp-bridge argument {i + 1} {word!r}: no newline or other "
                             "control character allowed in a batch script's arguments")
    words = tuple(shlex.quote(w) for w in argv)
    return JobCommand(("nutp-bridge", *words), ("nutp-bridge", "control", *words),
                      " ".join(("nutp-bridge sbatch", *words)))


def train_command(overrides: list[str], *, config_name: str = "config",
                  recipe: str | None = None) -> tuple[list[str], str]:
    """(bash words of the ``nutp-train`` call, extra script lines) for the job's config.

    A recipe is composed from ``$NUTP_REPO/recipes`` (``NUTP_CONFIG_DIR``) with ``configs/`` on
    Hydra's search path, which is what ``nemo_nutp.config.recipes.load_recipe`` does.
    """
    words = ["nutp-train"]
    extra = ""
    if recipe is not None:
        words += ["--config-name", shlex.quote(recipe),
                  f'"{searchpath_override("${NUTP_REPO}/configs")}"']
        extra = f'export {CONFIG_DIR}="${{NUTP_REPO}}/recipes"  # recipes/ is the primary dir\n'
    elif config_name != "config":
        words += ["--config-name", shlex.quote(config_name)]
    return words + [shlex.quote(o) for o in overrides], extra


_WRAPPER = r"""
# Runs inside the container once per GPU slot (srun task or torchrun worker): looks up the plan
# rank of (Slurm node id, local GPU), exposes only that GPU (so any device rule -- LOCAL_RANK or
# rank % device_count -- picks it) and execs the trainer with torch.distributed's env:// variables.
nutp_task() {
  local node=$SLURM_NODEID gpu row rank
  if [[ $NUTP_LAUNCHER == torchrun ]]; then gpu=$LOCAL_RANK; else gpu=$SLURM_LOCALID; fi
  row="NUTP_NODE_RANKS_${node}"
  if [[ -z ${!row:-} ]]; then
    echo "nutp: no rank table row for Slurm node ${node}" >&2
    exit 1
  fi
  local -a ranks visible
  read -r -a ranks <<< "${!row}"
  rank=${ranks[$gpu]}
  if (( rank < 0 )); then
    echo "nutp: node ${node} GPU ${gpu} is not in the plan (failed or idle)" >&2
    exit 0
  fi
  IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
  if (( ${#visible[@]} > gpu )); then gpu=${visible[$gpu]}; fi
  unset TORCHELASTIC_USE_AGENT_STORE  # rank 0 hosts the store at MASTER_ADDR, not torchrun
  export RANK=$rank WORLD_SIZE=$NUTP_WORLD_SIZE LOCAL_RANK=0 CUDA_VISIBLE_DEVICES=$gpu
  export MASTER_ADDR=$NUTP_MASTER_ADDR MASTER_PORT=$NUTP_MASTER_PORT
  exec "$@"
}
NUTP_TASK="$(declare -f nutp_task)"$'\n''nutp_task "$@"'
"""

_TABLE_DOC = """\
# Rank table. Slurm numbers tasks node by node (block distribution), which is not the plan's
# rank order: the plan keeps each TP group inside one NVLink domain, puts degraded replicas last
# and skips failed GPUs. So one task runs per GPU slot and nutp_task (below) maps the slot to its
# plan rank with this table instead of trusting SLURM_PROCID. --distribution=arbitrary would only
# choose the node of a task, not its GPU, so it cannot express this. Row k = Slurm node id k (the
# k-th host of `scontrol show hostnames`); entry j = plan rank on local GPU j, -1 = unused.
"""


def _header(plan: Plan, opts: SbatchOptions, nodes: int, command: str,
            recovery: Any = None, live: bool = False) -> str:
    c, m = plan.request.cluster, plan.request.model
    degrees = sorted({t for r in plan.replicas for t in r.tp}, reverse=True)
    tasks = c.gpus_per_node if opts.launcher == "srun" and not live else 1
    first = (f"# Plan: {plan.world_size} ranks on {nodes} nodes, {len(plan.replicas)} replicas, "
             f"TP degrees {degrees}, PP {plan.pp}, policy {plan.request.policy}.")
    if recovery is not None:
        first = (f"# Recovery: every GPU slot runs a worker; each attempt re-plans (first plan: "
                 f"{plan.world_size} ranks, TP degrees {degrees}); up to "
                 f"{recovery.max_restarts} restarts.")
    if live:
        first = (f"# Recovery, live: a control process and one node agent per node; failures "
                 f"re-lay out in place (first plan: {plan.world_size} ranks, TP degrees "
                 f"{degrees}); up to {recovery.max_restarts} restart fallbacks.")
    lines = [
        "#!/bin/bash",
        f"# Generated by `{' '.join(command.split()[:2])}`; re-render when the config, failed "
        "GPUs or code change:",
        f"#   {command}",
        f"# Cluster {c.name}: {c.num_gpus} GPUs, {c.gpus_per_node} per node, NVLink domain "
        f"{c.domain_size}. Model: {m.num_layers} layers, hidden {m.hidden_size}.",
        first,
        f"#SBATCH --job-name={opts.job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --gpus-per-node={c.gpus_per_node}",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --partition={opts.partition or '<partition>'}",
        f"#SBATCH --account={opts.account or '<account>'}",
        "#SBATCH --exclusive",
        "#SBATCH --output=%x-%j.out",
    ]
    if live or (recovery is not None and opts.launcher == "srun"):
        # a lost node must not end the job: the control process re-plans around it (live), or
        # the next attempt runs on the nodes left (the srun loop)
        lines.append("#SBATCH --no-kill")
    if opts.requeue:  # a requeued run appends its output to the first run's
        lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    if opts.nodelist:
        lines.append(f"#SBATCH --nodelist={opts.nodelist}")
    return "\n".join(lines) + "\n"


def _table(plan: Plan, table: NodeTable) -> str:
    gpn = table.gpus_per_node
    lines = [_TABLE_DOC.rstrip("\n"), f"export NUTP_WORLD_SIZE={plan.world_size}"]
    for k, (node, row) in enumerate(zip(table.nodes, table.rows)):
        ranks = " ".join(str(r) for r in row)
        lines.append(f'export NUTP_NODE_RANKS_{k}="{ranks}"  # cluster node {node}: GPUs '
                     f"{node * gpn}-{node * gpn + gpn - 1}")
    rank0_node = table.rank_slots()[0][0]
    lines += [
        "# Rank 0 hosts the torch.distributed store, so MASTER_ADDR is the host of its node.",
        f"NUTP_RANK0_NODE={rank0_node}",
        'NUTP_MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
        '| sed -n "$((NUTP_RANK0_NODE + 1))p")"',
    ]
    return "\n".join(lines) + "\n"


def _launch(opts: SbatchOptions, gpn: int, train: tuple[str, ...]) -> str:
    lines = [
        "# pyxis: the container runs every task; srun's environment (the table) is passed in.",
        'NUTP_SRUN=(--container-image="$NUTP_IMAGE" --container-workdir="$NUTP_REPO"',
        "           --no-container-mount-home --kill-on-bad-exit=1)",
        'if [[ -n "$NUTP_MOUNTS" ]]; then NUTP_SRUN+=(--container-mounts="$NUTP_MOUNTS"); fi',
        f"NUTP_TRAIN=({' '.join(train)})",
    ]
    if opts.launcher == "srun":
        lines += [
            "# One task per GPU slot; nutp_task turns the slot into the plan rank.",
            f'srun --ntasks-per-node={gpn} "${{NUTP_SRUN[@]}}" \\',
            '  bash -c "$NUTP_TASK" nutp-task "${NUTP_TRAIN[@]}"',
        ]
    else:
        lines += [
            "# One torchrun per node spawning one worker per GPU; torchrun's own ranks are",
            "# replaced by the plan's in nutp_task (LOCAL_RANK = local GPU of the worker).",
            'srun --ntasks-per-node=1 "${NUTP_SRUN[@]}" \\',
            f'  torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={gpn} \\',
            '  --rdzv-backend=c10d \\',
            '  --rdzv-endpoint="$NUTP_MASTER_ADDR:$((NUTP_MASTER_PORT + 1))" \\',
            '  --rdzv-id="$SLURM_JOB_ID" --no-python \\',
            '  bash -c "$NUTP_TASK" nutp-task "${NUTP_TRAIN[@]}"',
        ]
    return "\n".join(lines) + "\n"


_RECOVERY_DOC = """\
# Recovery (recovery.enabled=true): one worker per GPU slot of the whole cluster, numbered
# node-major (Slurm node id x GPUs per node + local GPU). Each attempt the workers agree on the
# failed GPUs (health report, device probes, who ended the previous attempt), re-plan, and the
# plan's ranks train while the other slots wait (nemo_nutp/train/elastic.py). Slurm node id k
# is taken to be cluster node k: pin hosts with --nodelist when GPU ids must match nodes.
"""

_WORKER = r"""
# srun task -> torch.distributed env:// worker of attempt $1 (its GPU slot comes from
# SLURM_NODEID and SLURM_LOCALID; rank 0 hosts the rendezvous store).
nutp_worker() {
  export NUTP_ATTEMPT=$1
  shift
  unset TORCHELASTIC_USE_AGENT_STORE
  export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
  export MASTER_ADDR=$NUTP_MASTER_ADDR MASTER_PORT=$((NUTP_MASTER_PORT + NUTP_ATTEMPT))
  exec "$@"
}
NUTP_WORKER="$(declare -f nutp_worker)"$'\n''nutp_worker "$@"'
"""


def _launch_recovery(opts: SbatchOptions, gpn: int, train: tuple[str, ...], recovery: Any
                     ) -> str:
    # srun: no --kill-on-bad-exit (its SIGKILL would leave no exit records to blame by): the
    # workers end an attempt themselves (store key "abort"); --wait bounds the rest.
    kill = (f"--kill-on-bad-exit=0 --wait={int(2 * recovery.heartbeat_timeout_s) + 60}"
            if opts.launcher == "srun" else "--kill-on-bad-exit=1")
    lines = [
        "# pyxis: the container runs every task; srun's environment is passed in.",
        'NUTP_SRUN=(--container-image="$NUTP_IMAGE" --container-workdir="$NUTP_REPO"',
        f"           --no-container-mount-home {kill})",
        'if [[ -n "$NUTP_MOUNTS" ]]; then NUTP_SRUN+=(--container-mounts="$NUTP_MOUNTS"); fi',
        f"NUTP_TRAIN=({' '.join(train)})",
    ]
    if opts.launcher == "srun":
        lines += [
            "# A failed worker ends its attempt for all (store key abort); the loop restarts, and",
            "# stops for good when the workers found no plan for the failed GPUs (exit code 2).",
            "# Each attempt runs on the nodes left in the allocation: Slurm removes a lost node",
            "# from a --no-kill job, and its node ids then shift (the workers key GPUs by host",
            "# name: health/nodes.py).",
            f"for attempt in $(seq 0 {recovery.max_restarts}); do",
            "  rc=0",
            '  NUTP_NODES="$(scontrol show job -o "$SLURM_JOB_ID" | tr " " "\\n" '
            '| sed -n "s/^NodeList=//p")"',
            '  NUTP_MASTER_ADDR="$(scontrol show hostnames "$NUTP_NODES" | sed -n 1p)"',
            '  NUTP_NNODES="$(scontrol show hostnames "$NUTP_NODES" | wc -l)"',
            # the batch environment's SLURM_NTASKS is the whole allocation's: say the count
            '  srun --nodes="$NUTP_NNODES" --nodelist="$NUTP_NODES" '
            f'--ntasks="$((NUTP_NNODES * {gpn}))" --ntasks-per-node={gpn} \\',
            '    "${NUTP_SRUN[@]}" \\',
            '    bash -c "$NUTP_WORKER" nutp-worker "$attempt" "${NUTP_TRAIN[@]}" || rc=$?',
            "  if (( rc == 0 )); then exit 0; fi",
            '  if (( rc == 2 )); then echo "nutp: no plan for the failed GPUs" >&2; exit 2; fi',
            '  echo "nutp: attempt $attempt failed (exit $rc); restarting with a new plan" >&2',
            "done",
            "exit 1",
        ]
        return _WORKER.lstrip("\n") + "\n".join(lines) + "\n"
    ft = []
    if opts.launcher == "ft_launcher":
        # ft_launcher terminates a rank that stops sending heartbeats; our watchdog (which can
        # name the rank that hung) must act first, so its timeouts are larger than ours.
        ft = [f"  --ft-initial-rank-heartbeat-timeout={2 * recovery.startup_timeout_s:g} \\",
              f"  --ft-rank-heartbeat-timeout={2 * recovery.heartbeat_timeout_s:g} \\"]
    lines += [
        f"# One {opts.launcher} per node; it restarts all workers when one fails. Its workers",
        "# keep SLURM_NODEID, which fixes their GPU slots across restarts.",
        'srun --ntasks-per-node=1 "${NUTP_SRUN[@]}" \\',
        f'  {opts.launcher} --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={gpn} \\',
        f"  --max-restarts={recovery.max_restarts} --rdzv-backend=c10d \\",
        '  --rdzv-endpoint="$NUTP_MASTER_ADDR:$NUTP_MASTER_PORT" \\',
        *ft,
        '  --rdzv-id="$SLURM_JOB_ID" --no-python "${NUTP_TRAIN[@]}"',
    ]
    return "\n".join(lines) + "\n"


_LIVE_DOC = """\
# Live recovery (recovery.mode=live, nemo_nutp/launch/control.py, agent.py). Two job
# steps, both started here, and no other for the whole job: failures, GPUs coming back and
# restart fallbacks are handled inside them.
# 1. The control process (one task on the first node, no GPU, --overlap beside the agents):
#    hosts the store, watches every rank, decides (live re-layout, grow back, stragglers,
#    restart fallback); it trains nothing. Its exit code is the job's.
# 2. One node agent per node (all of the node's GPUs): starts, kills and reports the node's
#    rank processes for the control process, including a returning GPU's new process.
# A dead rank (or agent) ends no peer: --kill-on-bad-exit=0, --wait=0, and --no-kill (the
# job's above and the agents' step's below) for a lost node. Slurm node id k is taken to be
# cluster node k: pin hosts with --nodelist when GPU ids must match nodes. output.dir must
# be on a filesystem every node shares. With --requeue: Slurm neither ends nor requeues a
# --no-kill job whose batch host fails, so an agent left resubmits this script as a new job
# (NUTP_REQUEUED, after this one ends; it resumes from the newest checkpoint) and cancels
# this one (at most recovery.max_restarts times).
"""


def _launch_live(opts: SbatchOptions, live: tuple[str, ...], recovery: Any) -> str:
    wait_agents = 60
    lines = [
        "# pyxis: the container runs every task; srun's environment is passed in.",
        'NUTP_SRUN=(--container-image="$NUTP_IMAGE" --container-workdir="$NUTP_REPO"',
        "           --no-container-mount-home)",
        'if [[ -n "$NUTP_MOUNTS" ]]; then NUTP_SRUN+=(--container-mounts="$NUTP_MOUNTS"); fi',
        f"NUTP_LIVE=({' '.join(live)})",
        'NUTP_CONTROL="$NUTP_MASTER_ADDR:$NUTP_MASTER_PORT"',
        "# --gpus-per-node=0: no GPU (Slurm refuses --gres=none inside a --gpus-per-node job).",
        "srun --nodes=1 --ntasks=1 --nodelist=\"$NUTP_MASTER_ADDR\" --overlap \\",
        "  --gpus-per-node=0 \\",
        '  "${NUTP_SRUN[@]}" "${NUTP_LIVE[@]}" --listen="$NUTP_MASTER_PORT" \\',
        '  --address="$NUTP_MASTER_ADDR" &',
        "NUTP_CONTROL_PID=$!",
        "# One agent per node; its task gets every CPU of the node (srun's default is one).",
        "# --no-kill: a lost node ends its own agent only (the job's --no-kill does not protect",
        "# a running step's other nodes).",
        'srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \\',
        "  --kill-on-bad-exit=0 --wait=0 --no-kill \\",
        '  "${NUTP_SRUN[@]}" python -m nemo_nutp.recovery.agent --control="$NUTP_CONTROL" \\',
        f"  --timeout={recovery.startup_timeout_s:g}"
        + (f" --max-requeues={recovery.max_restarts}" if opts.requeue else "") + " &",
        "NUTP_AGENTS_PID=$!",
        "rc=0",
        'wait "$NUTP_CONTROL_PID" || rc=$?',
        "# The control process told every agent to exit; one that cannot hear it is stopped.",
        f"for _ in $(seq {wait_agents}); do",
        '  kill -0 "$NUTP_AGENTS_PID" 2>/dev/null || break',
        "  sleep 1",
        "done",
        'kill "$NUTP_AGENTS_PID" 2>/dev/null || true',
        'wait "$NUTP_AGENTS_PID" 2>/dev/null || true',
        'if (( rc == 2 )); then echo "nutp: bad input or no plan for the failed GPUs" >&2; fi',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


_LIVE_ELSEWHERE = """\
# recovery.mode=live: {launcher} restarts all workers of a node when one exits, so failures
# take the restart path (the workers print this reason at start). Live re-layout on Slurm:
# nutp sbatch --launcher srun.
"""


def render_sbatch(plan: Plan, opts: SbatchOptions, *, overrides: list[str] | None = None,
                  config_name: str = "config", recipe: str | None = None,
                  recovery: Any = None, command: JobCommand | None = None) -> str:
    """The batch script text for ``plan`` (made from the same config + overrides).

    With ``recovery`` (the job's ``RecoveryConfig`` when ``recovery.enabled``) the script
    allocates the whole cluster and runs a worker per GPU slot under a restarting launcher
    (restart mode) or a control process and node agents (live mode). ``command``: what the
    script starts (default ``nutp_command(overrides, ...)``; ``nutp-bridge sbatch`` passes
    ``bridge_command``)."""
    if recovery is not None and opts.master_port + recovery.max_restarts > 65535:
        raise ValueError(f"master_port={opts.master_port}: the srun loop uses master_port + "
                         f"attempt, up to + recovery.max_restarts={recovery.max_restarts}; "
                         "must stay <= 65535")
    if opts.launcher == "ft_launcher" and recovery is None:
        raise ValueError("launcher='ft_launcher': needs recovery.enabled=true (ft_launcher "
                         "restarts the workers, which re-plan each attempt)")
    table = node_table(plan)
    if command is None:
        command = nutp_command(list(overrides or ()), config_name=config_name, recipe=recipe)
    train, extra, shown = command.rank, command.extra, command.shown
    mounts = ",".join(opts.mounts)
    setup = "\n".join([
        "set -euo pipefail",
        "",
        "# Container image and mounts (pyxis/enroot); NUTP_REPO = nemo_nutp's path in the image.",
        f'NUTP_IMAGE="${{NUTP_IMAGE:-{opts.image or "<image>"}}}"',
        f'NUTP_MOUNTS="${{NUTP_MOUNTS:-{mounts}}}"',
        f'NUTP_REPO="${{NUTP_REPO:-{opts.repo}}}"',
        'if [[ "$NUTP_IMAGE" == "<"* ]]; then',
        '  echo "set the container image: nutp sbatch --image, or NUTP_IMAGE=..." >&2',
        "  exit 2",
        "fi",
    ]) + "\n"
    env = (f"export NUTP_MASTER_ADDR NUTP_MASTER_PORT={opts.master_port} "
           f"NUTP_LAUNCHER={opts.launcher} NUTP_REPO\n{extra}")
    live = recovery is not None and recovery.mode == "live"
    if live and opts.launcher == "srun":
        c = plan.request.cluster
        where = "\n".join([
            _LIVE_DOC.rstrip("\n"),
            'NUTP_MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        ]) + "\n"
        return "\n".join([_header(plan, opts, c.num_gpus // c.gpus_per_node, shown, recovery,
                                  live=True), setup, where, env,
                          _launch_live(opts, command.control, recovery)])
    if recovery is not None:
        c = plan.request.cluster
        where = "\n".join([
            *([_LIVE_ELSEWHERE.format(launcher=opts.launcher).rstrip("\n")] if live else []),
            _RECOVERY_DOC.rstrip("\n"),
            f"export NUTP_WORLD_SIZE={c.num_gpus}",
            'NUTP_MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        ]) + "\n"
        return "\n".join([_header(plan, opts, c.num_gpus // c.gpus_per_node, shown, recovery),
                          setup, where, env,
                          _launch_recovery(opts, c.gpus_per_node, train, recovery)])
    parts = [_header(plan, opts, len(table.nodes), shown), setup, _table(plan, table), env,
             _WRAPPER.lstrip("\n"), _launch(opts, table.gpus_per_node, train)]
    return "\n".join(parts)


def write_text_atomic(text: str, path: str | Path, *, mode: int = 0o755) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``."""
    with atomic_path(path, mode=mode) as tmp:
        tmp.write_text(text)


def check_live_enabled(cfg: Any) -> None:
    if cfg.recovery.mode == "live" and not cfg.recovery.enabled:
        raise ValueError("recovery.mode='live': needs recovery.enabled=true (the control "
                         "process supervises the job)")



def options(args: argparse.Namespace) -> SbatchOptions:
    """The cluster-side options of ``add_options`` (``ValueError`` naming a bad one)."""
    return SbatchOptions(partition=args.partition, account=args.account, image=args.image,
                         mounts=tuple(m for arg in args.mounts for m in arg.split(",") if m),
                         time=args.time, job_name=args.job_name, launcher=args.launcher,
                         master_port=args.master_port, nodelist=args.nodelist,
                         repo=args.repo, requeue=args.requeue)


def write_script(text: str, out: str | Path, plan: Plan, cfg: Any, opts: SbatchOptions,
                 console: Any) -> None:
    """Write the script (atomically) and say where it runs and how to submit it."""
    write_text_atomic(text, out)
    nodes = len(node_table(plan).nodes)
    if cfg.recovery.enabled:
        nodes = plan.request.cluster.num_gpus // plan.request.cluster.gpus_per_node
    console.print(f"{out}: {plan.world_size} ranks on {nodes} nodes "
                  f"({opts.launcher}); submit with: sbatch {out}")


def run(args: argparse.Namespace) -> int:
    from ..common.console import make_console, print_error
    from ..config import plan_request
    from ..config.recipes import load_job, split_recipe
    from ..layout import build_plan

    console = make_console()
    try:
        recipe, overrides = split_recipe(args.overrides, args.recipe)
        cfg = load_job(overrides, config_name=args.config_name, recipe=recipe)
        check_live_enabled(cfg)
        plan = build_plan(plan_request(cfg))
        opts = options(args)
        text = render_sbatch(plan, opts, overrides=overrides, config_name=args.config_name,
                             recipe=recipe,
                             recovery=cfg.recovery if cfg.recovery.enabled else None)
    except ValueError as e:
        print_error(str(e))
        return 2
    write_script(text, args.out, plan, cfg, opts, console)
    return 0


def add_options(p: argparse.ArgumentParser) -> None:
    """The cluster-side options (``SbatchOptions``) of ``nutp sbatch`` and ``nutp-bridge
    sbatch``."""
    p.add_argument("--out", default="nutp.sbatch", help="script path (written atomically)")
    p.add_argument("--partition", help="Slurm partition (placeholder if omitted)")
    p.add_argument("--account", help="Slurm account (placeholder if omitted)")
    p.add_argument("--image", help="container image for pyxis (placeholder if omitted)")
    p.add_argument("--mounts", action="append", default=[], metavar="SRC:DST[,SRC:DST]",
                   help="container mounts (repeatable)")
    p.add_argument("--time", default="04:00:00", help="wall-clock limit")
    p.add_argument("--job-name", default="nutp", help="Slurm job name")
    p.add_argument("--launcher", choices=LAUNCHERS, default="srun",
                   help="srun: a task per GPU; torchrun/ft_launcher: a task per node "
                        "(ft_launcher = nvidia-resiliency-ext; needs recovery.enabled=true)")
    p.add_argument("--master-port", type=int, default=29500, help="rank 0's store port")
    p.add_argument("--nodelist", help="pin the hosts, in plan node order")
    p.add_argument("--repo", default="/opt/nemo_nutp", help="nemo_nutp's path in the image")
    p.add_argument("--requeue", action="store_true",
                   help="#SBATCH --requeue: Slurm may requeue the job (node failure, "
                        "preemption); live mode: the batch host lost, the node agents left "
                        "resubmit the job")


def add_parser(sub: Any) -> None:
    """Register ``sbatch`` on the ``nutp`` sub-command parser."""
    p = sub.add_parser("sbatch", help="render a Slurm batch script (pyxis container) for a job")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. recipe=llama3_8b_h100")
    p.add_argument("--recipe", help="a recipe in recipes/ (same as the override recipe=NAME)")
    p.add_argument("--config-name", default="config", help="primary config in configs/")
    add_options(p)
    p.set_defaults(func=run)
