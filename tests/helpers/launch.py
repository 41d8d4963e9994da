"""The one way tests start ``nutp-train`` as a process: ``python -m nemo_nutp.train`` (the
console script's module) with Hydra overrides, run to the end (``run_train``) or started in a
session of its own with its output in a log file (``start_train``: for tests that watch, kill
or time out a job; ``kill_session(proc.pid)`` ends it and every rank it spawned).

``env`` adds variables to this process's environment (``NUTP_FAULT``, ``NUTP_LIVE_DIGEST``,
torchrun's ``RANK``...), ``unset`` removes some; ``launcher`` puts a launcher's arguments between
the interpreter and ``-m nemo_nutp.train`` (``("-m", "torch.distributed.run", ...)``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

TRAIN_MODULE = "nemo_nutp.train"


def train_cmd(overrides: Iterable[str], *, launcher: Sequence[str] = ()) -> list[str]:
    """``[python, *launcher, -m, nemo_nutp.train, *overrides]``."""
    return [sys.executable, *launcher, "-m", TRAIN_MODULE, *overrides]


def train_env(env: Mapping[str, str] | None = None, unset: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment with ``env`` on top and ``unset`` removed."""
    out = {**os.environ, **(env or {})}
    for key in unset:
        out.pop(key, None)
    return out


def run_train(overrides: Iterable[str], *, env: Mapping[str, str] | None = None,
              unset: Iterable[str] = (), launcher: Sequence[str] = (), timeout: float = 600,
              check: bool = False, cwd: str | Path | None = None
              ) -> subprocess.CompletedProcess[str]:
    """Runs ``nutp-train`` to its exit, stdout and stderr captured as text. ``check=False`` (the
    default): the caller asserts on ``returncode`` and shows the output it wants."""
    return subprocess.run(train_cmd(overrides, launcher=launcher), capture_output=True,
                          text=True, timeout=timeout, check=check, cwd=cwd,
                          env=train_env(env, unset))


def start_train(overrides: Iterable[str], *, log: Path, env: Mapping[str, str] | None = None,
                unset: Iterable[str] = (), launcher: Sequence[str] = (),
                cwd: str | Path | None = None) -> subprocess.Popen[str]:
    """Starts ``nutp-train`` in a new session, stdout and stderr (merged) written to ``log``
    (truncated first). The caller waits, kills (``kill_session(proc.pid)``) and reads ``log``."""
    with log.open("w") as f:
        return subprocess.Popen(train_cmd(overrides, launcher=launcher), stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                cwd=cwd, env=train_env(env, unset))
