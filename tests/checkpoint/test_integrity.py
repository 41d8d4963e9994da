"""Issue 12: resume semantics, integrity that scales, atomic re-save, tracker == loader.

Pure-filesystem checks (no processes) plus one two-rank world (``integrity_jobs``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_nutp.checkpoint.megatron_format import (
    TRACKER,
    candidates,
    iter_dir,
    publish,
    restore_asides,
    write_tracker,
)
from nemo_nutp.checkpoint.store import find_latest, latest_step
from tests.helpers.dist import spawn


def _fake(root: Path, step: int, text: str = "x", *, tracker: bool = True) -> Path:
    """A directory that is complete as far as the filesystem rules go."""
    d = iter_dir(root, step)
    d.mkdir(parents=True)
    for name in ("metadata.json", ".metadata"):
        (d / name).write_text(text)
    (d / "nutp_checkpoint.json").write_text(json.dumps({"step": step}))
    if tracker:
        write_tracker(root, step)
    return d


def test_tracker_and_loader_agree(tmp_path: Path) -> None:
    _fake(tmp_path, 2)
    _fake(tmp_path, 4)
    assert find_latest(tmp_path) == iter_dir(tmp_path, 4) and latest_step(tmp_path) == 4
    write_tracker(tmp_path, 2)  # another run wrote step 2 after step 4 existed
    with pytest.warns(UserWarning, match=r"names step 2; newer checkpoints \['iter_0000004'\]"):
        assert candidates(tmp_path) == [iter_dir(tmp_path, 2)]
    with pytest.warns(UserWarning):
        assert find_latest(tmp_path) == iter_dir(tmp_path, 2)
    assert latest_step(tmp_path) == 2
    (tmp_path / TRACKER).unlink()  # no tracker (e.g. a copied directory): newest complete first
    assert candidates(tmp_path) == [iter_dir(tmp_path, 4), iter_dir(tmp_path, 2)]
    assert latest_step(tmp_path) is None


def test_release_tracker_names_converted_weights(tmp_path: Path) -> None:
    release = tmp_path / "release"
    release.mkdir()
    for name in ("metadata.json", ".metadata"):
        (release / name).write_text("x")
    (tmp_path / TRACKER).write_text("release\n")
    assert candidates(tmp_path) == [release]


def test_crash_during_resave_keeps_the_previous_copy(tmp_path: Path) -> None:
    final = _fake(tmp_path, 4, "old")
    tmp = tmp_path / "iter_0000004.tmp-1234"
    tmp.mkdir()
    for name in ("metadata.json", ".metadata"):
        (tmp / name).write_text("new")

    def crash() -> None:
        raise KeyboardInterrupt("killed between the renames")

    with pytest.raises(KeyboardInterrupt):
        publish(tmp, final, fault=crash)
    assert not final.exists()
    (aside,) = tmp_path.glob("iter_0000004.old-*")
    assert candidates(tmp_path, warn=False) == [aside]  # loadable as it is
    assert latest_step(tmp_path) == 4
    restore_asides(tmp_path)  # what rank 0 does before the next save or load
    assert (final / "metadata.json").read_text() == "old" and not aside.exists()
    publish(tmp, final)  # the re-save completes: the new copy, no aside left
    assert (final / "metadata.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", TRACKER]


@pytest.mark.parametrize("what", ["empty", "foreign", "partial"])
@pytest.mark.parametrize("resume", ["required", "auto"])
def test_given_path_with_nothing_loadable_exits_2(tmp_path: Path, what: str, resume: str,
                                                  capsys: Any) -> None:
    from nemo_nutp.launch.nutp_train import main

    src = tmp_path / "src"
    src.mkdir()
    if what == "foreign":
        (src / "model.safetensors").write_text("not megatron")
    if what == "partial":
        (src / "iter_0000002.tmp-dead").mkdir()
    rc = main([f"output.dir={tmp_path / 'out'}", f"checkpoint.resume={resume}",
               f"checkpoint.load_dir={src}"])
    err = capsys.readouterr()
    text = err.out + err.err
    assert rc == 2, text
    assert f"checkpoint.load_dir={src}" in text and "nothing loadable" in text, text
    if what == "foreign":
        assert "model.safetensors" in text, text


def test_resume_modes_without_a_given_path(tmp_path: Path) -> None:
    from nemo_nutp.checkpoint.hooks import resume_candidates
    from nemo_nutp.config import load_config

    cfg = load_config([f"output.dir={tmp_path}", "checkpoint.interval=2"])
    assert resume_candidates(cfg) == []  # auto, empty root: start fresh
    with pytest.raises(ValueError, match=r"checkpoint\.dir=.*nothing loadable.*does not exist"):
        resume_candidates(load_config([f"output.dir={tmp_path}", "checkpoint.interval=2",
                                       "checkpoint.resume=required"]))
    root = Path(str(cfg.checkpoint_dir))
    _fake(root, 2)
    assert resume_candidates(cfg) == [iter_dir(root, 2)]
    never = load_config([f"output.dir={tmp_path}", "checkpoint.interval=2",
                         "checkpoint.resume=false"])
    assert never.checkpoint.resume == "never" and resume_candidates(never) == []


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_parallel_hashing_fallback_strict_and_resave(tmp_path: Path) -> None:
    from tests.helpers.integrity_jobs import worker

    spawn(worker, 2, (), tmp_path)
    res = torch.load(tmp_path / "integrity.pt", weights_only=False)
    assert res["rank_hashes_equal_serial"], res["files"]
    assert any(f.startswith("__1_") for f in res["files"])  # rank 1 hashed its own shards
    assert res["after_resave"] == ["iter_0000002", "iter_0000004", TRACKER]
    for msg in res["strict_every_rank"]:
        assert "iter_0000004 is corrupt" in msg and res["corrupted"] in msg, msg
        assert "checkpoint.strict" in msg
    fb = res["fallback"]
    assert fb["path"] == "iter_0000002" and fb["step"] == 2, fb
    assert [Path(p).name for p in fb["skipped"]] == ["iter_0000004"]
    (said,) = fb["said"]
    assert said.startswith("WARNING") and "falling back to" in said and "iter_0000002" in said
    # continues exactly as the uninterrupted run (same plan: per-rank RNG states restored)
    assert res["resumed"] == res["losses"][2:], (res["resumed"], res["losses"])
    # the training loop's resume: one warning line, one resume line (step, layout)
    hooks = res["hooks"]
    assert hooks["start"] == 2, hooks
    warning, resumed = hooks["printed"]
    assert warning.startswith("WARNING: checkpoint") and "iter_0000004 is corrupt" in warning
    assert resumed.startswith("checkpoint: resumed") and "iter_0000002 (step 2, saved by TP2)" \
        in resumed, resumed


@pytest.mark.parametrize("key", ["output.dir", "checkpoint.dir"])
@pytest.mark.parametrize("where", ["proc", "file_in_the_way"])
def test_unwritable_output_or_checkpoint_dir_exits_2_before_any_process(
        tmp_path: Path, key: str, where: str, capsys: Any) -> None:
    """One line naming the key and the path, exit 2, nothing spawned (issue 25 item 5)."""
    import multiprocessing as mp

    from nemo_nutp.launch.nutp_train import main

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = "/proc/nutp_x" if where == "proc" else str(blocker / "sub")
    args = ([f"output.dir={bad}"] if key == "output.dir" else
            [f"output.dir={tmp_path / 'out'}", f"checkpoint.dir={bad}", "checkpoint.interval=2"])
    rc = main([*args, "train.steps=1"])
    err = capsys.readouterr()
    text = (err.out + err.err).strip()
    assert rc == 2, text
    assert f"{key}={bad}: cannot be created or written" in text, text
    assert len(text.splitlines()) == 1 and "Traceback" not in text, text
    assert mp.active_children() == []
