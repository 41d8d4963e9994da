"""The rank's stack watcher survives a frame whose ``f_lineno`` is None (CPython reports None
while a frame runs no line). It used to die in ``linecache.getline(file, None)``, printing a
traceback and leaving the hang detector without the rank's stack from then on."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_nutp.health import watch


def test_a_frame_without_a_line_number_is_sampled(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    me = threading.current_thread()
    code = SimpleNamespace(co_filename=__file__, co_name="step")
    frame = SimpleNamespace(f_code=code, f_lineno=None, f_back=None)
    monkeypatch.setattr(watch, "sys", SimpleNamespace(_current_frames=lambda: {me.ident: frame}))
    monkeypatch.setattr(watch, "SAMPLE_S", 0.01)
    out = tmp_path / "rank0.stack"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            watch.watch_stack(out, me)
        except BaseException as e:  # what the old watcher died of
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not out.exists() and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not errors, errors
    assert out.read_text().split("\n")[1] == f"{__file__}:0 in step"
    assert t.is_alive()


def test_the_watcher_follows_the_rank_into_the_next_world(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A live re-layout's next world (``watch.follow_world``): the watcher writes the new world's
    file (its heartbeat directory, the rank's new number) and counts collectives from zero --
    the old world's counts, uneven where the failure cut a collective short, would blame the
    wrong rank there. It used to stay on world 0's file: nobody blamed a hang after a
    re-layout (found on the Slurm test cluster, tests/launch/test_slurm_faults.py)."""
    me = threading.current_thread()
    monkeypatch.setattr(watch, "SAMPLE_S", 0.01)
    log = watch.CollectiveLog()
    log.entered = {"7": 3}  # collectives of the old world's group "7"
    first, second = tmp_path / "w0" / "rank5.stack", tmp_path / "w1" / "rank4.stack"
    first.parent.mkdir()
    second.parent.mkdir()
    follow = watch._Watcher(first, log)
    monkeypatch.setattr(watch, "_WATCHER", follow)
    threading.Thread(target=watch.watch_stack, args=(first, me, log, follow), daemon=True).start()
    deadline = time.monotonic() + 60
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.read_text().split("\n")[2] == '{"7": 3}'
    watch.follow_world(second)
    while not second.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert second.read_text().split("\n")[2] == "{}"  # counted from zero in the new world
    before = first.read_text()
    time.sleep(0.1)
    assert first.read_text() == before  # the old world's file is left alone
