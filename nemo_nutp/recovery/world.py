"""The world of rank processes the recovery supervisor and its live control loop share: the
fork-server preload list, one rank's entry point, how a world is stopped, and what one attempt
returns. Both ``supervisor`` (restart path) and ``control`` (live path) import it; it imports
neither."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.env import AGENT_PID, HEARTBEAT_DIR
from ..health import watch
from ..health.decisions import Failure

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan

PRELOAD = ("nemo_nutp.recovery.world", "nemo_nutp.train.worker", "nemo_nutp.train.loop",
           "nemo_nutp.train.session", "nemo_nutp.checkpoint.hooks",
           "megatron.core.dist_checkpointing")
"""Imported once by the fork server the ranks start from."""


@dataclass
class Attempt:
    ok: bool
    failure: Failure | None
    cause: str | None  # "exit" or "hang" with a failure
    scale_up: watch.ScaleUp | None
    detected_at: float
    last_done: int | None  # highest completed step index over ranks
    rank_to_gpu: tuple[int, ...]
    where: dict[int, str]  # blamed rank -> innermost frame of its main thread
    stop_s: float  # time taken to kill and reap the world


def _die_with(pid: int) -> None:
    """``AGENT_PID``, set by a node agent to its pid: its ranks end (SIGKILL to their process
    group) when the agent dies, so an agent that dies leaves no rank behind. (Not
    ``PR_SET_PDEATHSIG``: a rank's parent is the agent's fork server, which stays up while any
    process it forked lives.)"""
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # already gone
        os.killpg(0, signal.SIGKILL)
        return

    def wait() -> None:
        select.select([fd], [], [])  # readable when the process exits
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=wait, name="nutp-die-with-agent", daemon=True).start()


def enter(env: dict[str, str]) -> None:
    """A rank process's first steps: its own process group (the supervisor or agent stops it
    with its helpers), the environment it was given, and -- under a node agent -- its end with
    the agent."""
    os.setpgrp()
    os.environ.update(env)
    if env.get(AGENT_PID, "").isdigit():
        _die_with(int(env[AGENT_PID]))


def rank_main(rank: int, world: int, cfg: JobConfig, plan: Plan, port: int,
               env: dict[str, str], local: int | None = None) -> None:
    """``local``: the rank's device index on its node (a node agent's ranks; default: the
    rank, every rank on this machine)."""
    enter(env)
    watch.start_stack_watcher(Path(env[HEARTBEAT_DIR]) / f"rank{rank}.stack")
    from ..train.worker import run_rank

    run_rank(rank, world, rank if local is None else local, cfg, plan, port)


def join_main(slot: int, cfg: JobConfig, old_plan: Plan, gpu: int, gen: int,
               env: dict[str, str]) -> None:
    """A returning GPU's process (live grow back): joins world ``gen`` of a running job."""
    enter(env)
    from ..train.worker import join_rank

    join_rank(slot, cfg, old_plan, gpu, gen)


STANDBY_KEY = "standby/{gpu}"
"""Where the control process activates a hot spare's standby process (``standby_main``)."""


def standby_main(join: Callable[..., None], cfg: JobConfig, gpu: int,
                 env: dict[str, str]) -> None:
    """A hot spare's standby process (``recovery.spares``): started with the job, its imports
    done (the fork server's preload), connected to the control process's store, it waits until
    a failure's re-layout takes its GPU, then joins that world as a returning GPU's process
    does (``join``: the entry's, with the activation's slot, old plan, generation and
    heartbeat directory). Ends quietly when the control process goes away first."""
    import pickle
    from datetime import timedelta

    from ..common.env import CONTROL
    from ..live.link import connect

    enter(env)
    host, _, port = env[CONTROL].rpartition(":")
    key = STANDBY_KEY.format(gpu=gpu)
    try:
        store = connect(host, int(port), cfg.recovery.startup_timeout_s)
        while True:
            try:
                store.wait([key], timedelta(seconds=30))
                break
            except RuntimeError as e:  # a wait that timed out: still standing by
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise
        slot, old_plan, gen, hb = pickle.loads(store.get(key))
    except Exception:  # the control process ended (the job is over): nothing to join
        os._exit(0)
    join(slot, cfg, old_plan, gpu, gen, {**env, HEARTBEAT_DIR: hb})


@dataclass(frozen=True)
class RankEntry:
    """How a rank process starts: ``target(rank, world, job, plan, port, env)`` (a node
    agent's rank also gets ``local=``, its device index on its node) in a process forked from a
    server that imported ``preload`` once. Default: ``nutp-train``'s rank (``rank_main``);
    ``nutp-bridge`` passes its own (``launch/bridge_cli.py: bridge_entry``). The supervisor's
    fork server and ``hosts.LocalHost`` use it on this machine; ``hosts.AgentHost`` sends it,
    pickled with the job, to the node agents (``recovery/agent.py``), which start the same
    entry on their nodes: it must pickle (module-level functions, ``functools.partial``)."""

    target: Callable[..., None] = rank_main
    preload: tuple[str, ...] = PRELOAD
    join: Callable[..., None] = join_main
    """A returning GPU's process under ``recovery.mode=live``: ``join(slot, job, old_plan,
    gpu, gen, env)`` (default ``join_main``)."""


def stop_procs(procs: list[Any]) -> None:
    for p in procs:
        # Survivors block in collectives with the dead rank; checkpoint writer helpers of a
        # killed rank would outlive it (and hold the job's stdout), so kill whole groups.
        if p.pid is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet its own group leader (or gone): the process
                p.kill()
    for p in procs:
        p.join()
