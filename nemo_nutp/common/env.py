"""Every ``NUTP_*`` environment variable name, spelled once. Python code uses these constants,
never the quoted name (``tests/test_env_names.py`` checks). The scripts ``launch/slurm.py``
renders spell their names out in shell text; the second group lists the names only they use,
so every name is in this one place."""

# Read or set by Python code
ATTEMPT = "NUTP_ATTEMPT"  # the supervisor's (or the sbatch srun loop's) attempt number, 0 first
HEARTBEAT_DIR = "NUTP_HEARTBEAT_DIR"  # a rank's directory for step heartbeats and stack files
EVENTS = "NUTP_EVENTS"  # the recovery event log (recovery/events.jsonl) ranks append to
CONTROL = "NUTP_CONTROL"  # host:port of the live control process's store (recovery.mode=live)
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"  # how often Slurm requeued this batch job
REQUEUED = "NUTP_REQUEUED"  # how often the job was resubmitted after losing its batch host
SLURM_NODE_NAME = "SLURMD_NODENAME"  # Slurm's name of the node a job step's task runs on
AGENT_PID = "NUTP_AGENT_PID"  # a node agent's pid: its ranks die with it (recovery/world.py)
PARENT_REPORTS = "NUTP_PARENT_REPORTS"  # "1": the local launcher prints its ranks' errors
DEBUG = "NUTP_DEBUG"  # "1": a rank's error is raised with its traceback, not reported in a line
FAULT = "NUTP_FAULT"  # injected faults (common/faults.py grammar); wins over recovery.fault(s)
LIVE_FAULT = "NUTP_LIVE_FAULT"  # deprecated: old positional phase faults, added to NUTP_FAULT's
LIVE_DIGEST = "NUTP_LIVE_DIGEST"  # "1": rank 0 logs every replica's state digest at the end
CONFIG_DIR = "NUTP_CONFIG_DIR"  # the YAML config tree (default: the repository's configs/)
RECIPES_DIR = "NUTP_RECIPES_DIR"  # the recipes tree (default: the repository's recipes/)
NODE_INDEX = "NUTP_NODE_INDEX"  # this node's index under an external launcher (GPU slots)
NODE_DIR = "NUTP_NODE_DIR"  # node-local directory of heartbeat and stack files (/dev/shm)

# Only in the rendered sbatch scripts (launch/slurm.py)
REPO = "NUTP_REPO"  # nemo_nutp's path in the container image
IMAGE = "NUTP_IMAGE"  # the container image (pyxis/enroot)
MOUNTS = "NUTP_MOUNTS"  # the container mounts, comma separated
LAUNCHER = "NUTP_LAUNCHER"  # what starts the tasks: srun, torchrun or ft_launcher
WORLD_SIZE = "NUTP_WORLD_SIZE"  # the plan's world size (or the cluster's GPUs under recovery)
NODE_RANKS_ = "NUTP_NODE_RANKS_"  # + <k>: the plan rank of each GPU of Slurm node k (-1: none)
RANK0_NODE = "NUTP_RANK0_NODE"  # the Slurm node of plan rank 0 (it hosts the store)
MASTER_ADDR = "NUTP_MASTER_ADDR"  # the host of the store (rank 0's, or the control process's)
MASTER_PORT = "NUTP_MASTER_PORT"  # its port (the srun recovery loop adds the attempt)
SRUN = "NUTP_SRUN"  # srun's container arguments (a bash array)
TRAIN = "NUTP_TRAIN"  # the nutp-train command line (a bash array)
LIVE = "NUTP_LIVE"  # the live control process's command line (a bash array)
TASK = "NUTP_TASK"  # the body of nutp_task: slot -> plan rank, then exec the trainer
WORKER = "NUTP_WORKER"  # the body of nutp_worker: a recovery worker of attempt $1
CONTROL_PID = "NUTP_CONTROL_PID"  # the live control process's job step (background pid)
AGENTS_PID = "NUTP_AGENTS_PID"  # the node agents' job step (background pid)


def requeued(environ: dict[str, str] | None = None) -> int:
    """How many runs of this job came before this one (0: the first run): the resubmissions
    after a lost batch host (``NUTP_REQUEUED``, set by the node agent that resubmitted the job's
    script: ``recovery/agent.py``) plus Slurm's own requeues of this job
    (``SLURM_RESTART_COUNT``). A requeued run is a new allocation that carries the health
    report and node table over and fires no injected fault again."""
    import os

    env = os.environ if environ is None else environ
    return sum(int(v) for v in (env.get(REQUEUED, ""), env.get(SLURM_RESTART_COUNT, ""))
               if v.isdigit())
