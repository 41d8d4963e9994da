"""One run per ``output.dir``: a lock file taken before anything is written there.

``<output.dir>/.nutp.lock`` holds JSON ``{pid, host, started, job}`` (``job``: the launcher's job
id, ``SLURM_JOB_ID`` or ``TORCHELASTIC_RUN_ID``, else empty). Taking it:

* no lock, or the lock is ours: take it (``O_CREAT | O_EXCL`` on a temp name, then ``link``, so two
  runs racing for it cannot both win);
* held by a live process on this host, or by another host in another job: ``OutputLocked``
  (a ``ValueError``: exit 2), naming the holder;
* held by a dead process on this host (a run that crashed or was killed): taken over with a
  one-line warning on stderr; by the same launcher job (a restart of it, any host): taken over
  silently.

Not guaranteed: a holder on another host in another job is never presumed dead (its pid cannot be
checked from here): remove the file by hand once that run is gone; the message says so.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

LOCK_NAME = ".nutp.lock"


class OutputLocked(ValueError):
    """Another run holds ``output.dir``."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: float
    job: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        job = f", job {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.host} since {when}{job}"


def _job_id() -> str:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


def _me() -> Holder:
    return Holder(os.getpid(), socket.gethostname(), time.time(), _job_id())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def read_holder(out_dir: Path) -> Holder | None:
    try:
        d = json.loads((out_dir / LOCK_NAME).read_text())
        return Holder(int(d["pid"]), str(d["host"]), float(d["started"]), str(d.get("job", "")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # half-written or foreign: stale
        return Holder(-1, "?", 0.0, "")


class OutputLock:
    """The lock of one ``output.dir`` (``acquire`` / ``release``; a context manager)."""

    def __init__(self, out_dir: str | Path, *,
                 warn: Callable[[str], None] | None = None) -> None:
        self.warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
        self.dir = Path(out_dir)
        self.path = self.dir / LOCK_NAME
        self.me = _me()
        self.held = False

    def _stale_reason(self, h: Holder) -> str | None:
        """Why ``h`` no longer holds the directory (None: it does)."""
        if h.pid == self.me.pid and h.host == self.me.host:
            return "ours"
        if h.job and h.job == self.me.job:
            return "same job"
        if h.pid < 0:
            return "unreadable lock file"
        if h.host == self.me.host and not _alive(h.pid):
            return "dead"
        return None

    def acquire(self) -> OutputLock:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"{LOCK_NAME}.{self.me.pid}.tmp"
        try:
            for _ in range(3):  # a holder that just released: take it on the next pass
                tmp.write_text(json.dumps(asdict(self.me)) + "\n")
                try:
                    os.link(tmp, self.path)  # atomic: fails if the lock exists
                    self.held = True
                    return self
                except FileExistsError:
                    pass
                h = read_holder(self.dir)
                if h is None:
                    continue
                why = self._stale_reason(h)
                if why is None:
                    raise OutputLocked(
                        f"output.dir={self.dir} is in use by another run ({h.describe()}); "
                        "choose another output.dir, or stop that run (if it is gone, delete "
                        f"{self.path})")
                if why == "dead":
                    self.warn(f"output.dir={self.dir}: taking over the lock of a run that is "
                              f"gone ({h.describe()})")
                os.replace(tmp, self.path)  # two takers: the last one holds it, the other sees
                if read_holder(self.dir) == self.me:  # a live holder on its next pass
                    self.held = True
                    return self
            raise OutputLocked(f"output.dir={self.dir}: could not take {self.path}")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held and read_holder(self.dir) == self.me:
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
