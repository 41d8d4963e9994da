"""CPU stand-ins for ``srun`` and ``scontrol``, for running rendered ``nutp sbatch`` scripts.

``install(bindir)`` writes both into ``bindir`` (put it first on ``PATH``). The job's nodes are
the comma-separated hosts of ``SLURM_JOB_NODELIST`` (all on this machine; Slurm node id k = the
k-th). What the ``srun`` stand-in honours, as Slurm documents it:

* tasks: ``--nodes=N`` (the first N nodes, or the ``--nodelist`` host), ``--ntasks=N`` or
  ``--ntasks-per-node=N`` (block distribution); each task gets ``SLURM_PROCID``,
  ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``, ``SLURM_STEP_ID`` and runs in its own
  process group (in the caller's session: a test can kill the whole job by session);
* ``--kill-on-bad-exit=1``: a task that exits non-zero gets every other task SIGKILLed at once;
  ``=0``: the others run on;
* ``--cpus-per-task=N``: ``SLURM_CPUS_PER_TASK`` (no CPU binding on one machine);
* ``--wait=N``: N seconds after the first task ends the rest are SIGKILLed (0: no limit);
* SIGTERM/SIGINT to srun: forwarded to every task (SIGKILL after 10 s), as srun cancels a step;
* the exit code: 0 if every task exited 0, else the largest (absolute) code.

Accepted and ignored, because a CPU machine has nothing to do with them: the pyxis container
options (``--container-image/-workdir/-mounts``, ``--no-container-mount-home``: tasks run on
the host), ``--overlap`` and ``--gpus-per-node=0`` (no resources are counted), ``--no-kill``
(no node is lost here). Any other option is an
error (exit 2, naming it): a script that relies on a flag this stand-in does not implement fails
here instead of passing for the wrong reason. Every job step is appended to
``$NUTP_FAKE_SLURM_LOG`` (one JSON line: argv, tasks), so tests can count job steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SRUN = r'''#!{python}
import json, os, signal, subprocess, sys, time
IGNORED_VALUE = ("--container-image", "--container-workdir", "--container-mounts")
IGNORED_FLAG = ("--no-container-mount-home", "--overlap", "--no-kill")
args = sys.argv[1:]
opt = {{}}
while args and args[0].startswith("-"):
    a = args.pop(0)
    key, _, value = a.partition("=")
    if key in IGNORED_FLAG and not value:
        continue
    if key in IGNORED_VALUE and value:
        continue
    if key == "--gpus-per-node" and value == "0":
        continue
    if key in ("--nodes", "--ntasks", "--ntasks-per-node", "--wait",
               "--cpus-per-task") and value.isdigit():
        opt[key] = int(value)
    elif key == "--kill-on-bad-exit" and value in ("0", "1"):
        opt[key] = value == "1"
    elif key == "--nodelist" and value:
        opt[key] = value
    else:
        sys.exit(f"srun (stand-in): unsupported option {{a!r}}")
if not args:
    sys.exit("srun (stand-in): no command")
hosts = [h for h in os.environ.get("SLURM_JOB_NODELIST", "").split(",") if h]
if not hosts:
    sys.exit("srun (stand-in): SLURM_JOB_NODELIST is not set")
nodes = list(range(len(hosts)))
if "--nodelist" in opt:
    if opt["--nodelist"] not in hosts:
        sys.exit(f"srun (stand-in): --nodelist={{opt['--nodelist']}} is not in the job")
    nodes = [hosts.index(opt["--nodelist"])]
nodes = nodes[:opt.get("--nodes", len(nodes))]
if "--ntasks-per-node" in opt:
    placed = [(n, i) for n in nodes for i in range(opt["--ntasks-per-node"])]
elif "--ntasks" in opt:
    k = opt["--ntasks"]
    per = -(-k // len(nodes))
    placed = [(nodes[t // per], t % per) for t in range(k)]
else:
    placed = [(n, 0) for n in nodes]
log = os.environ.get("NUTP_FAKE_SLURM_LOG")
step = 0
if log:
    with open(log, "a+") as f:
        f.seek(0)
        step = len(f.read().splitlines())
        f.write(json.dumps({{"argv": sys.argv[1:], "tasks": len(placed), "t": time.time()}}) + "\n")
def env(t, node, local):
    return dict(os.environ, SLURM_PROCID=str(t), SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node), SLURM_NTASKS=str(len(placed)), SLURM_STEP_ID=str(step),
                SLURM_CPUS_PER_TASK=str(opt.get("--cpus-per-task", 1)))
procs = [subprocess.Popen(args, env=env(t, n, i), process_group=0)
         for t, (n, i) in enumerate(placed)]
def kill_all(sig):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
def on_signal(signum, frame):
    kill_all(signal.SIGTERM)
    deadline = time.time() + 10
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    kill_all(signal.SIGKILL)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
first_end = None
wait = opt.get("--wait", 0)
while any(p.poll() is None for p in procs):
    ended = [p for p in procs if p.poll() is not None]
    if ended and first_end is None:
        first_end = time.time()
    bad = opt.get("--kill-on-bad-exit", False) and any(p.returncode != 0 for p in ended)
    if bad or (wait and first_end is not None and time.time() - first_end > wait):
        kill_all(signal.SIGKILL)
        break
    time.sleep(0.05)
codes = [p.wait() for p in procs]
sys.exit(0 if all(c == 0 for c in codes) else max(abs(c) for c in codes))
'''

SCONTROL = r'''#!{python}
import os, sys
if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit(f"scontrol (stand-in): only 'show hostnames' is implemented, not {{sys.argv[1:]}}")
print("\n".join(h for h in os.environ.get("SLURM_JOB_NODELIST", "").split(",") if h))
'''


def install(bindir: Path) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        path = bindir / name
        path.write_text(text.format(python=sys.executable))
        path.chmod(0o755)


def job_steps(log: Path) -> list[dict]:
    """The job steps the stand-in started (``NUTP_FAKE_SLURM_LOG``)."""
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
