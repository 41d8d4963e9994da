"""One training rank: join the process group (NCCL on GPU, gloo on CPU) and train.

Used by every way a rank starts: ``nutp-train``'s local spawn, a launcher (``torchrun``/``srun``)
and the recovery supervisor's forked ranks.

An error inside a rank ends the rank with exit code 2 (bad input: a ``ValueError``, a corrupt or
missing checkpoint or data file) or 1 (anything else). Its traceback goes to
``<output.dir>/logs/rank<r>.log`` and a one-line record to ``<output.dir>/logs/error.rank<r>.json``
(``{t, rank, code, message}``), which the local launcher prints as one line; under an external
launcher the rank prints that line itself. The rank leaves with ``os._exit``: no interpreter
shutdown, so no destructor tracebacks of half-built objects follow the error. ``NUTP_DEBUG=1``
lets the exception propagate as it is (traceback on the console).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.env import DEBUG, PARENT_REPORTS

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..layout import Plan

def error_code(e: BaseException) -> int:
    """2 for bad input (config values, data or checkpoint files), 1 for a runtime failure."""
    from ..checkpoint.store import CheckpointError

    return 2 if isinstance(e, (ValueError, CheckpointError, FileNotFoundError)) else 1


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg if isinstance(e, ValueError) and msg else f"{type(e).__name__}: {msg}"


def report_error(out_dir: str | Path, rank: int, e: BaseException) -> int:
    """Log ``e`` (traceback) and its one-line record under ``out_dir/logs``; return the exit
    code. Best effort: a log that cannot be written does not hide the error."""
    code = error_code(e)
    logs = Path(out_dir) / "logs"
    line = one_line(e)
    log = logs / f"rank{rank}.log"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}\n")
            f.write("".join(traceback.format_exception(e)))
        tmp = logs / f".error.rank{rank}.json.tmp"
        tmp.write_text(json.dumps({"t": time.time(), "rank": rank, "code": code,
                                   "message": line, "log": str(log)}) + "\n")
        os.replace(tmp, logs / f"error.rank{rank}.json")
    except OSError:
        pass
    if os.environ.get(PARENT_REPORTS) != "1":
        print(f"error: rank {rank}: {line} (details: {log})", file=sys.stderr, flush=True)
    return code


def first_error(out_dir: str | Path, since: float) -> dict[str, Any] | None:
    """The earliest error record a rank wrote after ``since`` (the root cause, usually: its
    peers then fail on the broken connection)."""
    found = []
    for f in (Path(out_dir) / "logs").glob("error.rank*.json"):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("t", 0) >= since:
            found.append(rec)
    return min(found, key=lambda r: r["t"]) if found else None


def _rank_warnings(rank: int) -> None:
    """Warnings show once per job, not once per rank: rank 0 shows every warning but
    megatron's optional-kernel notes (``common/quiet.py``); the other ranks run the same code
    and would repeat them W times."""
    import torch

    from ..common.quiet import filter_notes

    if rank == 0:
        filter_notes()
        if not torch.cuda.is_available():  # a GPU setting: says nothing on CPU
            warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    else:
        warnings.filterwarnings("ignore")


def _rank_device(local: int) -> Any:
    """This rank's CUDA device (set as current), or None on CPU (CPU patches on, 1 thread)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    from ..compat.cpu import apply_cpu_patches

    apply_cpu_patches()
    torch.set_num_threads(1)
    return None


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(cfg: JobConfig, rank: int, e: Exception) -> None:
    """A rank's error: one record for the launcher (``report_error``), then exit with its code
    (``NUTP_DEBUG=1``: raise instead)."""
    if os.environ.get(DEBUG) == "1":
        raise e
    _exit(report_error(cfg.output.dir, rank, e))


def run_rank(rank: int, world: int, local_rank: int, cfg: JobConfig, plan: Plan,
              port: int | None) -> None:
    import torch.distributed as dist

    _rank_warnings(rank)
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = _rank_device(local_rank)
    backend = "gloo" if device is None else "nccl"
    try:
        link = live_link(rank, world, backend, cfg)
        if link is None:
            dist.init_process_group(backend, rank=rank, world_size=world)
        from .loop import train_rank

        train_rank(cfg, plan, device=device, link=link)
        if link is not None:
            # Abandoned worlds' groups are kept alive (live/backend.py): their destructors
            # would wait for peers doing the same.
            _exit(0)
        dist.destroy_process_group()
    except Exception as e:
        _fail(cfg, rank, e)


def join_rank(slot: int, cfg: JobConfig, old_plan: Plan, gpu: int, gen: int) -> None:
    """A returning GPU's new process under ``recovery.mode=live`` (grow back): connect to the
    control process's store, join world ``gen`` with the state moved from the survivors, train
    on. Errors end the process as in ``run_rank``."""
    import torch

    from ..live.link import LiveRank, control_address

    _rank_warnings(slot)
    # the GPU's local index on its node (the plan's GPU ids are node-major)
    device = _rank_device(gpu % max(1, torch.cuda.device_count()))
    try:
        addr = control_address()
        assert addr is not None, "a joiner is started by the live control process"
        link = LiveRank(addr[0], addr[1], slot=slot, timeout_s=cfg.recovery.startup_timeout_s)
        link.start(gen=gen, cfg=cfg)
        from .loop import train_rank

        train_rank(cfg, old_plan, device=device, link=link, joining=gpu)
        _exit(0)
    except Exception as e:
        _fail(cfg, slot, e)


def live_link(rank: int, world: int, backend: str, cfg: JobConfig) -> Any:
    """``recovery.mode=live`` under the supervisor: world 0 on the control process's store."""
    from ..live.link import LiveRank, control_address

    addr = control_address()
    if addr is None:
        return None
    from ..live import backend as live_backend

    link = LiveRank(addr[0], addr[1], slot=rank, timeout_s=cfg.recovery.startup_timeout_s)
    link.start(cfg=cfg)
    live_backend.join(link.store, gen=0, rank=rank, world=world, backend=backend,
                      timeout_s=1800.0)
    return link


def spawned(rank: int, world: int, cfg: JobConfig, plan: Plan, port: int) -> None:
    run_rank(rank, world, rank, cfg, plan, port)
