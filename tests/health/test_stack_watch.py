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
