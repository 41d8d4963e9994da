"""The live control process as a process of its own (Slurm: ``nutp sbatch ... recovery.mode=live``).

``python -m nemo_nutp.launch.control --listen PORT [--address HOST] <overrides>`` (and, for a
Megatron-Bridge recipe, ``nutp-bridge control --listen PORT [--address HOST] <its arguments>``:
the same process through ``serve``, whose ranks are Bridge's) is the CPU supervisor
(``supervisor.supervise``, the live control loop of ``control.py``: the same code, not a copy)
with one difference: its ranks are started, killed and watched through the node agents
(``recovery/agent.py``, one per node, ``hosts.AgentHost``) instead of a fork server on this
machine. It trains nothing and holds no GPU. It

* validates and plans the job before anything starts (one line and exit 2 on bad input, as
  ``nutp-train``), takes the output directory's lock;
* serves the agents' store on ``--listen`` (every node's agent connects to
  ``--address:PORT``), and for every world a fresh per-world store (``control.host_store``)
  the ranks reach at ``--address``;
* makes every decision: live re-layout after a failure (survivors keep their processes: no
  new job step), grow back and stragglers (the returning GPU's node agent starts its process),
  the restart fallback (the agents kill the world and start the next attempt: still no new job
  step);
* ends the job: tells every agent to exit, and exits with the supervisor's code.

``output.dir`` must be on a filesystem every node shares (checkpoints, the health report,
events and the ranks' heartbeat files are read there).
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..recovery.world import RankEntry


def check_live(cfg: JobConfig) -> None:
    if not cfg.recovery.enabled:
        raise ValueError(f"recovery.enabled={cfg.recovery.enabled}: the control process "
                         "supervises the job (set recovery.enabled=true)")
    if cfg.recovery.mode != "live":
        raise ValueError(f"recovery.mode={cfg.recovery.mode!r}: the standalone control process "
                         "runs recovery.mode=live only")


def serve(cfg: JobConfig, listen: int, address: str | None, console: Any,
          entry: RankEntry | None = None) -> int:
    """Serve the node agents on ``listen`` and run the job through them to its end; the exit
    code. ``entry``: what the agents start for a rank (``recovery.world.RankEntry``; default
    ``nutp-train``'s, ``nutp-bridge control`` passes Bridge's). Bad input (the port, the
    output directory in use) is one line and 2, before anything starts."""
    from ..common.console import print_error
    from ..common.output_lock import OutputLock
    from ..recovery.hosts import AgentHost, agent_store
    from ..recovery.supervisor import supervise
    from ..recovery.world import RankEntry

    try:
        if not 1024 <= listen < 65536:
            raise ValueError(f"--listen={listen}: must be a port in 1024..65535")
        lock = OutputLock(cfg.output.dir).acquire()
    except ValueError as e:
        print_error(str(e))
        return 2
    try:
        c = cfg.cluster
        # the server listens on every interface; this host is only its own client's way in
        store = agent_store("127.0.0.1", listen, is_master=True,
                            timeout_s=cfg.recovery.startup_timeout_s)
        host = AgentHost(store, nodes=c.num_gpus // c.gpus_per_node,
                         gpus_per_node=c.gpus_per_node,
                         address=address or socket.gethostname(),
                         reply_timeout_s=cfg.recovery.startup_timeout_s,
                         entry=entry or RankEntry())
        try:
            host.wait_names()  # before the first plan: a requeued run's failed GPUs follow hosts
            return supervise(cfg, console, host)
        finally:
            host.close()
    finally:
        lock.release()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_nutp.launch.control",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for nutp-train")
    ap.add_argument("--config-name", default="config", help="primary config in configs/")
    ap.add_argument("--listen", type=int, required=True, help="port of the agents' store")
    ap.add_argument("--address", default=None,
                    help="this host as the agents and ranks reach it (default: hostname)")
    args = ap.parse_intermixed_args(argv)
    from ..common.console import make_console, print_error
    from ..common.quiet import quiet_optional_kernel_notes
    from ..config import plan_request
    from ..config.recipes import load_job
    from ..layout import build_plan
    from .nutp_train import preflight

    quiet_optional_kernel_notes()
    console = make_console()
    try:
        if not 1024 <= args.listen < 65536:
            raise ValueError(f"--listen={args.listen}: must be a port in 1024..65535")
        cfg = load_job(args.overrides, config_name=args.config_name)
        check_live(cfg)
        plan = build_plan(plan_request(cfg))
        preflight(cfg, plan)
    except ValueError as e:
        print_error(str(e))
        return 2
    return serve(cfg, args.listen, args.address, console)


if __name__ == "__main__":
    sys.exit(main())
