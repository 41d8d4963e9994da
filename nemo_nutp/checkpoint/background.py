"""Checkpoint saves off the critical path, with megatron-core's async save machinery.

``save_checkpoint(..., background=saves)`` builds the sharded state dict and calls
``dist_checkpointing.save(..., async_sharded_save=True)`` (torch_dist strategy: plan, then an
``AsyncRequest``); ``BackgroundSaves.schedule`` hands it to megatron's ``AsyncCallsQueue``
(``TemporalAsyncCaller``): the request's preload copies this rank's shard state to host memory
(a device-to-host copy on GPUs; on CPU the tensors already are host memory and the *fork* is the
snapshot: copy-on-write pages keep the saved values while training changes the live ones), and a
forked writer process writes the files while training continues. The writer is NUTP's wrapper
around megatron's: it asks for SIGKILL when its rank dies (so do the per-file writers it forks),
runs at the lowest CPU priority (``nice 19``: on a busy host the write waits, not the steps), runs
megatron's writer, then hashes the files this rank wrote (by name) into a small sidecar.

Finalisation (``poll`` each step, ``wait`` before the next save, a planned layout change or the
end of the run) is collective and runs when every rank's writer has ended (megatron's one-integer
all-reduce per check): megatron's finalisers (torch DCP ``.metadata``, ``metadata.json``; a
failed writer raises on every rank), then NUTP's: the digests to rank 0, ``nutp_checkpoint.json``,
the atomic rename and the tracker (``store._publish``). Only then is the save complete: the save
line and the ``checkpoint`` event come from ``on_done``.

At most one save is in flight: ``schedule`` first waits for the previous one. A failure (an
exception in a writer, no space left) aborts the save: rank 0 removes its ``.tmp`` directory and
``on_failed`` gets one line; the previous complete checkpoint stays the one to resume from. A
rank that dies mid-write takes its writers with it; its peers block in the next collective and
the recovery supervisor restarts the world from the previous checkpoint (the ``.tmp`` directory
is never loaded). Per-rank cost: one forked writer (plus megatron's per-file writers) per save,
one integer all-reduce per step while a save is in flight, one small object per rank gathered on
rank 0 at finalisation.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import integrity

SIDECAR = ".nutp_sha256.{rank}.json"
"""Digests of a rank's files, written by its background writer, read and removed at
finalisation (never part of a published checkpoint)."""


def snapshot_bytes(request: Any) -> int:
    """Bytes this rank's request stages to host memory (its snapshot): tensor data plus the
    serialised objects (RNG, extra state)."""
    args: Any = getattr(request, "async_fn_args", None) or ()
    if len(args) < 2:
        return 0
    total = 0
    for _path, _name, (bytes_data, tensor_data) in args[1]:
        total += sum(t.numel() * t.element_size() for _item, t in tensor_data)
        total += sum(len(b.getbuffer()) if hasattr(b, "getbuffer") else 0
                     for _item, b in bytes_data)
    return total


def _writer_dies_with_parent(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from ..common.procs import die_with_parent

    die_with_parent()
    return original(*args, **kwargs)


def _background_write(fn: Callable[..., Any], directory: str, rank: int, *args: Any,
                      **kwargs: Any) -> None:
    """Body of the forked writer: die with the rank (and make megatron's per-file writers die
    with this process), write, then hash this rank's files into the sidecar."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from ..common.procs import die_with_parent

    die_with_parent()
    # Training keeps the CPU: the writer (and the per-file writers it forks, which inherit
    # this) runs at the lowest CPU priority, so on a busy host the write waits, not the steps.
    os.nice(19)
    original = FileSystemWriterAsync.write_preloaded_data
    # This process is a fork used for one save: patching its copy of the class touches nothing
    # in the training process (megatron forks one writer per file from here).
    FileSystemWriterAsync.write_preloaded_data = staticmethod(  # type: ignore[method-assign]
        partial(_writer_dies_with_parent, original))
    fn(*args, **kwargs)
    d = Path(directory)
    digests = integrity.hash_own_files(d, rank, rank0_files=False)
    if rank == 0 and (d / "common.pt").is_file():
        digests["common.pt"] = integrity.sha256_file(d / "common.pt")
    tmp = d / (SIDECAR.format(rank=rank) + ".tmp")
    tmp.write_text(json.dumps(digests))
    os.replace(tmp, d / SIDECAR.format(rank=rank))


def _own_digests(directory: Path, rank: int) -> dict[str, str]:
    """The sidecar's digests (removed), plus rank 0's files written at finalisation."""
    side = directory / SIDECAR.format(rank=rank)
    digests: dict[str, str] = {}
    if side.is_file():
        digests = json.loads(side.read_text())
        side.unlink()
    if rank == 0:
        late = [n for n in integrity.RANK0_FILES if n not in digests
                and (directory / n).is_file()]
        digests.update(integrity.hash_files(directory, late))
    return digests


def why_failed(e: BaseException) -> str:
    """One line: torch DCP's ``CheckpointException`` names only the failed ranks; their first
    error (e.g. ``[Errno 28] No space left on device``) is in ``failures``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, f = sorted(failures.items())[0]
        exc = f[0] if isinstance(f, tuple) else f
        cause = getattr(exc, "__cause__", None) or exc
        return f"rank {rank}: {type(cause).__name__}: {cause}".splitlines()[0]
    return f"{type(e).__name__}: {e}".splitlines()[0]


@dataclass
class Pending:
    """The save in flight."""

    step: int
    tmp: Path
    final: Path
    started: float  # time.time() when scheduled
    stall_s: float  # time the training ranks spent in ``save_checkpoint`` for it
    snapshot_bytes: int
    info: dict[str, Any] = field(default_factory=dict)


class BackgroundSaves:
    """At most one background save at a time (see the module docstring). Collective methods:
    ``schedule``, ``poll``, ``wait``."""

    def __init__(self, *, on_done: Callable[[Pending, float], None] | None = None,
                 on_failed: Callable[[Pending, str], None] | None = None) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        self.pending: Pending | None = None
        self.on_done, self.on_failed = on_done, on_failed
        self.rank = dist.get_rank()
        self.last_snapshot_bytes = 0

    def schedule(self, request: Any, tmp: Path, final: Path, step: int,
                 publish: Callable[[dict[str, str]], None]) -> None:
        """Start writing ``request`` in the background (after the previous save finished)."""
        self.wait()
        t0 = time.time()
        fn = request.async_fn
        if fn is not None:
            request = request._replace(async_fn=partial(_background_write, fn, str(tmp),
                                                        self.rank))
        request.add_finalize_fn(lambda: publish(_own_digests(tmp, self.rank)))
        self.pending = Pending(step, tmp, final, t0, 0.0, snapshot_bytes(request))
        self.last_snapshot_bytes = self.pending.snapshot_bytes
        self.queue.schedule_async_request(request)

    def poll(self) -> bool:
        """Finalise the save in flight if every rank's writer is done (never blocks on the
        write). True when none is left in flight."""
        return self._finalize(blocking=False)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete or aborted."""
        self._finalize(blocking=True)

    def _finalize(self, *, blocking: bool) -> bool:
        p = self.pending
        if p is None:
            return True
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            done = bool(self.queue.maybe_finalize_async_calls(blocking=blocking))
        except (Exception, CheckpointException) as e:  # a writer failed (any rank): abort
            self.pending = None
            self.queue = type(self.queue)(persistent=False)
            self._abort(p, why_failed(e))
            return True
        if not done:
            return False
        self.pending = None
        if self.on_done is not None:
            self.on_done(p, time.time() - p.started)
        return True

    def _abort(self, p: Pending, why: str) -> None:
        if self.rank == 0:
            shutil.rmtree(p.tmp, ignore_errors=True)
        first = why.splitlines()[0] if why else "?"
        line = (f"checkpoint: save of step {p.step} to {p.tmp} failed, aborted ({first}); "
                "the previous complete checkpoint stays the one to resume from")
        if self.on_failed is not None:
            self.on_failed(p, line)

    def close(self) -> None:
        """End of the run: finish the save in flight."""
        self.wait()

    def abandon(self) -> None:
        """Kill this rank's writer of the save in flight and forget the save (local: no
        collective; for a world that failed)."""
        if self.pending is None:
            return
        for call in list(self.queue.async_calls):
            process = getattr(call.async_caller, "process", None)
            if process is not None:
                process.kill()
                process.join()
        self.queue = type(self.queue)(persistent=False)
        self.pending = None


def host_snapshot_bytes_all(local: int) -> int:
    """Largest per-rank snapshot (bytes) over the ranks (one all-reduce on the control group)."""
    t = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=integrity.control_group())
    return int(t.item())
