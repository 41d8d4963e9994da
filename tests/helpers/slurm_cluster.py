"""A real Slurm on this machine for the tests: munged, slurmctld and three slurmd, all on loopback.

``SlurmCluster(root).start()`` writes ``slurm.conf``, ``gres.conf``, ``plugstack.conf`` and a
munge key under ``root`` from the templates below, builds the container-flags SPANK plugin
(``tests/helpers/slurm/container_flags.c``: pyxis's ``--container-*`` options accepted, so the
scripts ``nutp sbatch`` renders run unchanged), and starts

* munged (its own key and socket under ``root``),
* slurmctld, and
* one slurmd per node ``n1``..``n3`` (Debian's Slurm has multiple-slurmd support: each node is
  a slurmd on this host with its own port), 4 fake GPUs each (``gres.conf``,
  ``AutoDetect=off``, points at character devices made here with /dev/null's numbers; Slurm
  sets ``CUDA_VISIBLE_DEVICES``), ``CPUs=8`` declared through
  ``SlurmdParameters=config_overrides``.

Node names resolve inside the jobs because every slurmd runs in a private mount namespace
(``unshare -m``) where ``/etc/hosts`` is a bind-mounted copy that adds ``n1``..``n3`` ->
127.0.0.1; the machine's own ``/etc/hosts`` is untouched. Job steps inherit that namespace, so
the rendered script's ``MASTER_ADDR`` (a node name) resolves. Every address is on loopback.

``stop()`` cancels the jobs and ends exactly the daemons it started, by pid (SIGTERM, then
SIGKILL). ``missing_prerequisite()`` names the first thing this machine lacks (root, the Slurm
binaries, gcc, the Slurm headers, CAP_SYS_ADMIN for ``unshare -m``), or None.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from nemo_nutp.common.ports import free_port

NODES = ("n1", "n2", "n3")
GPUS_PER_NODE = 4
CPUS = 8
PARTITION = "debug"
START_TIMEOUT_S = 30
PLUGIN_SRC = Path(__file__).parent / "slurm" / "container_flags.c"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol",
            "scancel", "unshare", "mount")

SLURM_CONF = """\
# Test cluster (tests/helpers/slurm_cluster.py). Everything on 127.0.0.1.
ClusterName=nutp-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/ctld
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/slurmd.%n.pid
SlurmdLogFile={root}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdTimeout=10
SlurmctldTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=30
{nodes}
PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

NODE_LINE = ("NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
             "CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def missing_prerequisite() -> str | None:
    """One line naming what this machine lacks for the test cluster, or None."""
    if os.geteuid() != 0:
        return "slurm test cluster: needs root (munged, slurmd and unshare -m run as root)"
    for b in BINARIES:
        if shutil.which(b) is None and not Path("/usr/sbin", b).exists():
            return (f"slurm test cluster: {b} not found (make test installs it: apt-get install "
                    "slurmctld slurmd slurm-client munge libslurm-dev)")
    if shutil.which("gcc") is None:
        return "slurm test cluster: gcc not found (it builds the container-flags SPANK plugin)"
    if not Path("/usr/include/slurm/spank.h").exists():
        return "slurm test cluster: /usr/include/slurm/spank.h not found (apt-get install " \
               "libslurm-dev)"
    r = _run(["unshare", "-m", "true"])
    if r.returncode != 0:
        return ("slurm test cluster: unshare -m failed (needs CAP_SYS_ADMIN for the nodes' "
                f"private /etc/hosts): {r.stderr.strip()}")
    return None


def _parent(pid: int) -> int | None:
    try:  # the field after the parenthesised command name
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    root: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    start_s: float = 0.0

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing at the test cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *cmd: str, check: bool = True) -> str:
        r = _run(list(cmd), env=self.env())
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def _write(self) -> None:
        root = self.root
        for d in ("munge", "ctld", *(f"dev/{n}" for n in NODES), *(f"spool/{n}" for n in NODES)):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o711)  # clients reach the socket: the folder needs o+x
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        host = socket.gethostname()
        ports = {n: free_port() for n in NODES}
        nodes = "\n".join(NODE_LINE.format(name=n, host=host, port=ports[n], cpus=CPUS,
                                           gpus=GPUS_PER_NODE) for n in NODES)
        self.conf.write_text(SLURM_CONF.format(
            root=root, host=host, ctld_port=free_port(), slurmd_port=free_port(), nodes=nodes,
            partition=PARTITION))
        gres = ["AutoDetect=off"]
        for n in NODES:
            files = []
            for g in range(GPUS_PER_NODE):
                f = root / "dev" / n / f"nvidia{g}"  # a character device (/dev/null's
                if not f.exists():                      # numbers): Slurm checks the type
                    os.mknod(f, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
                files.append(str(f))
            gres += [f"NodeName={n} Name=gpu File={f}" for f in files]
        (root / "gres.conf").write_text("\n".join(gres) + "\n")
        plugin = root / "container_flags.so"
        r = _run(["gcc", "-shared", "-fPIC", "-Wall", "-o", str(plugin), str(PLUGIN_SRC)])
        if r.returncode != 0:
            raise RuntimeError(f"gcc {PLUGIN_SRC}: {r.stderr.strip()}")
        (root / "plugstack.conf").write_text(f"required {plugin}\n")
        hosts = Path("/etc/hosts").read_text()
        (root / "hosts").write_text(hosts + "".join(f"127.0.0.1 {n}\n" for n in NODES))

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = (self.root / f"{name}.out").open("w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env(),
                                            start_new_session=True)

    def start(self) -> SlurmCluster:
        t0 = time.monotonic()
        self._write()
        m = self.root / "munge"
        self._spawn("munged", [_sbin("munged"), "-F", "--force", f"--key-file={m}/munge.key",
                               f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
                               f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
        deadline = t0 + START_TIMEOUT_S
        while not (m / "munge.socket").exists():
            self._check_alive(deadline, "munged socket")
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-f", str(self.conf)])
        for n in NODES:
            self._spawn_slurmd(n)
        while True:
            r = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env())
            idle = [x for x in r.stdout.split("\n") if x.endswith(" idle")]
            if r.returncode == 0 and len(idle) == len(NODES):
                break
            self._check_alive(deadline, f"{len(NODES)} idle nodes (sinfo: {r.stdout.strip()} "
                                        f"{r.stderr.strip()})")
        self.start_s = time.monotonic() - t0
        return self

    def _check_alive(self, deadline: float, what: str) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"slurm test cluster: {name} exited {p.returncode} before "
                                   f"{what}; see {self.root}/{name}.out and the logs there")
        if time.monotonic() > deadline:
            raise RuntimeError(f"slurm test cluster: no {what} within {START_TIMEOUT_S} s; "
                               f"logs in {self.root}")
        time.sleep(0.1)

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job`` (kept ``MinJobAge`` s after it ends)."""
        out = self.run("scontrol", "show", "job", "-o", job)
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def job_steps(self, job: str) -> list[int]:
        """The ids of the job steps launched for ``job`` (srun steps; the batch step is not one),
        from the slurmd logs' ``launch task StepId=<job>.<step>`` lines (no accounting here)."""
        pat = re.compile(rf"launch task StepId={re.escape(job)}\.(\d+) ")
        steps = {int(m.group(1)) for n in NODES
                 for m in pat.finditer((self.root / f"slurmd.{n}.log").read_text())}
        return sorted(steps)

    def crash_node(self, node: str, job: str) -> list[int]:
        """Node ``node`` fails as a machine does: its slurmd is SIGKILLed, then the job's step
        daemons there (``slurmstepd``: else the batch step's would report the batch script's
        death, and the job would end instead of being requeued) and every process of ``job``'s
        steps on it (their pids from ``scontrol listpids``, read first; a task's parent is its
        step's slurmstepd). Returns the tasks' pids. slurmctld finds the node not responding
        after ``SlurmdTimeout``."""
        out = self.run("scontrol", "listpids", job, node)
        pids = [int(line.split()[0]) for line in out.splitlines()[1:] if line.strip()]
        stepds = {pp for pid in pids if (pp := _parent(pid)) and _comm(pp) == "slurmstepd"}
        self.procs[f"slurmd-{node}"].kill()
        self.procs[f"slurmd-{node}"].wait()
        for pid in [*stepds, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def restart_node(self, node: str) -> None:
        """Start ``node``'s slurmd again (after ``crash_node``) and wait until it is idle
        (``ReturnToService=2``: a DOWN node returns when its slurmd registers)."""
        self._spawn_slurmd(node)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            r = _run(["sinfo", "-h", "-n", node, "-o", "%t"], env=self.env())
            if r.returncode == 0 and r.stdout.strip() == "idle":
                return
            self._check_alive(deadline, f"{node} idle again (sinfo: {r.stdout.strip()})")

    def _spawn_slurmd(self, n: str) -> None:
        hosts = self.root / "hosts"  # exec keeps the pid: unshare -> sh -> slurmd
        self._spawn(f"slurmd-{n}", [
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount --bind "{hosts}" /etc/hosts && exec "{_sbin("slurmd")}" -D -N {n} '
            f'-f "{self.conf}"'])

    def stop(self) -> None:
        """Cancel every job, wait for their steps to end, then end the daemons started here."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            _run(["scancel", "--full", "--quiet", "-u", "root"], env=self.env())
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = _run(["squeue", "-h", "-o", "%i"], env=self.env())
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.2)
        for name in [*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged"]:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
