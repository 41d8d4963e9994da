"""Spawned worlds of Bridge ranks that start with Bridge imported.

``dist.spawn``'s ranks fork from the test session's fork server, which imports torch and
megatron-core only (``launch/local.py`` ``PRELOAD``): every Bridge rank then imports Bridge,
its recipes and ``transformers`` itself, about 12 CPU-s a rank before its first step (a 3-rank
world: half a minute of a 2-core machine). ``spawn_bridge`` starts its worlds from a fork server
of their own that imported those once (``bridge_fork_preload``): one relay process, started on
first use, runs ``launch.local.start_ranks`` for each world with that preload (a process's fork
server keeps the preload it started with, so the session's own server, already started by
other tests, cannot take it). Each world gets the caller's environment at the call, as
``dist.spawn``'s do.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

PRELOAD = ("tests.helpers.bridge_fork_preload",)
"""What the Bridge fork server imports (after ``launch.local.PRELOAD``)."""

_relay: list[Any] = []  # (process, connection) once started


def _relay_main(conn: Any) -> None:
    """The relay: ``start_ranks(fn, args, world)`` for each request, from its own fork server
    (preloaded with Bridge); answers None or the error's text; ends at None or EOF."""
    from nemo_nutp.launch.local import PRELOAD as BASE
    from nemo_nutp.launch.local import start_ranks

    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        if req is None:
            return
        fn, args, world, env = req
        os.environ.clear()
        os.environ.update(env)
        try:
            start_ranks(fn, args, world, preload=(*BASE, *PRELOAD))
            conn.send(None)
        except BaseException as e:  # a rank's failure: the caller raises it
            conn.send(f"{type(e).__name__}: {e}")


def _stop() -> None:
    if _relay:
        proc, conn = _relay.pop()
        try:
            conn.send(None)
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _connection() -> Any:
    import multiprocessing

    if not _relay or not _relay[0][0].is_alive():
        _relay.clear()
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_relay_main, args=(theirs,), name="bridge-fork-relay")
        proc.start()
        theirs.close()
        _relay.append((proc, mine))
        atexit.register(_stop)
    return _relay[0][1]


def spawn_bridge(worker: Callable[..., None], world: int, args: tuple[Any, ...],
                 outdir: Path) -> None:
    """``dist.spawn(worker, world, args, outdir)`` with ranks that start with Bridge imported;
    print the first rank error on failure."""
    from .dist import free_port

    conn = _connection()
    try:
        try:
            conn.send((worker, (world, free_port(), *args, str(outdir)), world,
                       dict(os.environ)))
            err = conn.recv()
        except BaseException:  # e.g. the test's timeout: the next world gets a fresh relay
            proc, _ = _relay.pop()
            proc.kill()
            raise
        if err is not None:
            raise RuntimeError(f"a rank of the Bridge world failed: {err}")
    finally:
        errors = sorted(outdir.glob("error_rank*.txt"))
        if errors:
            print(errors[0].read_text())
