"""Megatron-LM / Megatron-Bridge checkpoint directories: naming, the tracker, what a path holds.

A checkpoint root::

    iter_0000004/                      a checkpoint: megatron-core dist_checkpointing (torch_dist)
                                       files, plus ``nutp_checkpoint.json`` when NUTP saved it
    iter_0000006.tmp-1a2b/             a save in progress, or one that crashed: never loaded
    iter_0000004.old-1a2b/             the previous copy during a re-save of step 4 (rename
                                       aside, then swap); used if the swap never happened
    latest_checkpointed_iteration.txt  the step the loader uses (Megatron-LM's tracker; the
                                       text 'release' names ``release/``, converted weights)

Contract:
* a directory is *complete* when megatron-core's ``metadata.json`` and torch DCP's ``.metadata``
  exist (both are written after every shard); ``nutp_checkpoint.json`` (plan, model dims,
  checksums) is never required to load, and stock megatron-core ignores it;
* ``candidates(root)`` is the loader's order and the tracker decides it: the tracker's step
  first, then older complete checkpoints newest first (fallbacks). Complete directories *newer*
  than the tracker (left by another run) are ignored with a warning. Without a tracker: every
  complete checkpoint, newest first. So the tracker and the loader always agree;
* every function here is pure filesystem (no process group), usable before any process exists.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"
META = "nutp_checkpoint.json"
MEGATRON_FILES = ("metadata.json", ".metadata")
_NAME = re.compile(r"iter_(\d+)(?:\.(tmp|old)-[0-9a-f]+)?$")


def iter_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary name, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _tracker_text(root: Path) -> str | None:
    try:
        return (Path(root) / TRACKER).read_text().strip()
    except OSError:
        return None


def read_tracker(root: Path) -> int | None:
    """The tracker's step (None: no tracker or not a number, e.g. Megatron's 'release')."""
    try:
        return int((Path(root) / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def write_tracker(root: Path, step: int) -> None:
    write_atomic(Path(root) / TRACKER, f"{step}\n")


def is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in MEGATRON_FILES)


def read_meta(path: Path) -> dict[str, Any] | None:
    """NUTP's metadata beside a checkpoint (None: not saved by NUTP, or unreadable)."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class Entry:
    step: int
    path: Path
    state: str  # "final", "aside" (.old-), "partial" (.tmp-)


def scan(root: Path) -> list[Entry]:
    """Every ``iter_*`` directory under ``root`` (any state), by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and d.is_dir():
            state = {None: "final", "old": "aside", "tmp": "partial"}[m.group(2)]
            out.append(Entry(int(m.group(1)), d, state))
    return sorted(out, key=lambda e: (e.step, e.state != "final", e.path.name))


def complete_by_step(root: Path) -> dict[int, Path]:
    """Step -> the complete copy to load (the final directory, else an aside copy)."""
    out: dict[int, Path] = {}
    for e in scan(root):
        if e.state == "partial":
            continue
        if e.step not in out and is_complete(e.path):
            out[e.step] = e.path
    return out


def candidates(root: Path, *, warn: bool = True) -> list[Path]:
    """Complete checkpoints under ``root`` in the loader's order (see the module docstring)."""
    root = Path(root)
    release = root / "release"  # Megatron's convention for converted weights
    if _tracker_text(root) == "release" and is_complete(release):
        return [release]
    found = complete_by_step(root)
    tracked = read_tracker(root)
    steps = sorted(found, reverse=True)
    if tracked is not None:
        newer = [s for s in steps if s > tracked]
        if newer and warn:
            warnings.warn(f"{root}: {TRACKER} names step {tracked}; newer checkpoints "
                          f"{[found[s].name for s in newer]} (left by another run?) are ignored",
                          stacklevel=2)
        steps = [s for s in steps if s <= tracked]
    if warn:
        for e in scan(root):
            if e.state == "partial" or not is_complete(e.path):
                warnings.warn(f"checkpoint {e.path}: incomplete (crashed or partial save; no "
                              f"{' or '.join(MEGATRON_FILES)}); ignored", stacklevel=2)
    return [found[s] for s in steps]


def step_of(path: Path) -> int | None:
    meta = read_meta(path)
    if meta is not None and "step" in meta:
        return int(meta["step"])
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def describe(path: Path, limit: int = 8) -> str:
    """What a path holds, for error messages."""
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file, not a directory"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "it is empty"
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} entries)"
                                         if len(names) > limit else "")
    return f"it holds {shown}"


def sources(path: Path) -> list[Path]:
    """A load path's candidates: itself if it is one checkpoint, else the root's candidates."""
    path = Path(path)
    if path.is_dir() and is_complete(path):
        return [path]
    return candidates(path)


def restore_asides(root: Path) -> None:
    """After a crash during a re-save: put an aside copy back where its swap left nothing, and
    drop asides whose final directory is complete (rank 0, before saving or loading)."""
    for e in scan(root):
        if e.state != "aside":
            continue
        final = iter_dir(root, e.step)
        if not final.exists() and is_complete(e.path):
            os.replace(e.path, final)
            fsync_dir(Path(root))
        elif is_complete(final):
            import shutil

            shutil.rmtree(e.path, ignore_errors=True)


def publish(tmp: Path, final: Path, *, fault: Any = None) -> None:
    """Make ``tmp`` the checkpoint ``final``: an existing ``final`` is renamed aside first and
    removed only after the swap, so a crash at any point leaves one complete copy on disk.
    ``fault`` (tests): called between the two renames."""
    import shutil

    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.old-{secrets.token_hex(4)}")
        os.replace(final, aside)
    if fault is not None:
        fault()
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
