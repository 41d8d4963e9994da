"""Atomic, layout-portable checkpoints of a training session (megatron ``dist_checkpointing``).

Directory layout under a checkpoint root::

    step_00000004/            a complete checkpoint (torch_dist shards + common.pt + COMPLETE)
    step_00000006.tmp-1a2b/   a save in progress, or one that crashed: never loaded
    latest                    text file naming the newest complete checkpoint (atomic replace)

Guarantees:
* a save writes into ``step_N.tmp-XXXX``; rank 0 writes ``COMPLETE`` (JSON: step, model dims,
  plan summary, global shapes, sha256 of every file) only after every rank finished, then
  renames the directory to ``step_N`` and replaces ``latest``. A crash at any point before the
  rename leaves the previous checkpoint the newest complete one;
* ``find_latest`` ignores (with a warning) directories without ``COMPLETE``;
* ``load_checkpoint`` raises ``CheckpointError`` naming the problem for a missing or corrupt
  checkpoint (checksum mismatch) and ``ValueError`` naming the field for different model dims;
* the layout of the saving run does not matter: tensors are stored as global tensors (see
  ``sharding``), so any plan of the same model loads them, optimizer state included.

Collective: ``save_checkpoint`` and ``load_checkpoint`` must be called by every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .sharding import global_shapes, model_sharded_state_dict

MARKER = "COMPLETE"
FORMAT = "nemo_nutp.checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _checksums(directory: Path) -> dict[str, str]:
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MARKER:
            out[str(p.relative_to(directory))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _dims(model_cfg: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(model_cfg) and not isinstance(model_cfg, type):
        return dataclasses.asdict(model_cfg)
    return {}


def _plan_summary(plan: Any) -> dict[str, Any]:
    return {"world_size": plan.world_size, "replica_tp": [list(r.tp) for r in plan.replicas],
            "microbatches": [r.microbatches for r in plan.replicas],
            "rank_to_gpu": list(plan.rank_to_gpu)}


def _state_dict(session: Any, *, is_loading: bool) -> dict[str, Any]:
    ctx = session.groups.ctx
    model = model_sharded_state_dict(session.gpt, session.model_cfg,
                                     replica=ctx.replica, tp_rank=ctx.tp_rank)
    optim = session.optimizer.sharded_state_dict(model, is_loading=is_loading)
    return {"model": model, "optimizer": optim}


def _rng_states() -> dict[str, Any]:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _rng_object(plan: Any, data: Any) -> Any:
    """This rank's RNG states as one entry of a per-rank object (megatron's own checkpoints
    keep ``rng_state`` the same way); only a run with the same plan can load it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", data, (plan.world_size,), (dist.get_rank(),),
                         replica_id=0)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(session: Any, root: str | Path, *, step: int,
                    extra: dict[str, Any] | None = None, fault: Any = None) -> Path:
    """Save model, optimizer, ``step`` (steps completed = next step to run), RNG (every rank's
    CPU/CUDA states, plus rank 0's CPU state for other layouts) and ``extra``
    (JSON-able, taken from rank 0) atomically under ``root``; returns the final directory.

    ``fault`` (tests): a callable run by every rank after its shards are written and before
    the checkpoint is marked complete (a crash there must leave the previous one valid).
    """
    from megatron.core import dist_checkpointing

    from ..procs import results_queue_dies_with_rank

    results_queue_dies_with_rank()  # no orphaned helper holds the job's output after a crash
    root = Path(root)
    rank0 = dist.get_rank() == 0
    tmp = root / f"step_{step:08d}.tmp-{_broadcast(secrets.token_hex(4))}"
    if rank0:
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _state_dict(session, is_loading=False)
    # Identical on every rank (megatron checks the common part for consistency).
    state["train"] = _broadcast({"step": step, "extra": extra or {},
                                 "rng": torch.get_rng_state()} if rank0 else None)
    state["rng"] = _rng_object(session.plan, _rng_states())
    dist_checkpointing.save(state, str(tmp))
    if fault is not None:
        fault()
    dist.barrier()
    final = step_dir(root, step)
    if rank0:
        marker = {"format": FORMAT, "step": step, "model": _dims(session.model_cfg),
                  "plan": _plan_summary(session.plan),
                  "global_shapes": global_shapes(session.gpt, session.model_cfg),
                  "files": _checksums(tmp), "rng_per_rank": True}
        _write_atomic(tmp / MARKER, json.dumps(marker, indent=1))
        if final.exists():  # an older save of the same step (e.g. before a restart)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / "latest", final.name + "\n")
    dist.barrier()
    return final


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def find_latest(root: str | Path) -> Path | None:
    """Newest complete checkpoint under ``root`` (None if there is none). Pure filesystem."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in root.iterdir():
        if not d.is_dir() or not d.name.startswith("step_"):
            continue
        marker = read_marker(d)
        if marker is None or ".tmp-" in d.name:
            warnings.warn(f"checkpoint {d}: no {MARKER} marker (crashed or partial save); "
                          "ignored", stacklevel=2)
            continue
        if best is None or marker["step"] > best[0]:
            best = (int(marker["step"]), d)
    return None if best is None else best[1]


def check_compatible(marker: dict[str, Any], model_cfg: Any, path: Path) -> None:
    """Model dims of the checkpoint must equal the job's: ``ValueError`` naming the field."""
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {marker.get('format')!r}, expected {FORMAT!r}")
    mine = _dims(model_cfg)
    for key, value in mine.items():
        if key in marker["model"] and marker["model"][key] != value:
            raise ValueError(f"model.{key}={value!r}: checkpoint {path} was saved with "
                             f"model.{key}={marker['model'][key]!r}")


def verify_files(marker: dict[str, Any], path: Path) -> None:
    found = _checksums(path)
    for name, digest in marker["files"].items():
        if name not in found:
            raise CheckpointError(f"checkpoint {path} is corrupt: file {name} is missing")
        if found[name] != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: checksum of {name} differs")


def load_checkpoint(session: Any, path: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """Load a complete checkpoint into ``session`` (any layout). Returns ``{"step", "extra",
    "marker"}``. Raises before touching the model if the checkpoint is incomplete, corrupt or
    for a different model."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    marker = read_marker(path)
    if marker is None:
        raise CheckpointError(f"checkpoint {path}: no {MARKER} marker (incomplete save?)")
    check_compatible(marker, session.model_cfg, path)
    problem = None
    if dist.get_rank() == 0 and verify:
        try:
            verify_files(marker, path)
        except CheckpointError as e:
            problem = str(e)
    problem = _broadcast(problem)
    if problem:
        raise CheckpointError(problem)
    state = _state_dict(session, is_loading=True)
    state["train"] = None
    # Per-rank RNG states come back only into the same plan (rank r is the same GPU and role);
    # any other layout gets rank 0's CPU state on every rank (no per-rank meaning there).
    same_plan = (marker.get("rng_per_rank", False)  # older checkpoints have no per-rank RNG
                 and marker.get("plan") == _plan_summary(session.plan))
    if same_plan:
        state["rng"] = _rng_object(session.plan, None)
    loaded = dist_checkpointing.load(state, str(path))
    with torch.no_grad():
        for name, p in session.gpt.named_parameters():
            p.copy_(loaded["model"][name.removeprefix("module.")].view_as(p))
    session.optimizer.load_state_dict(loaded["optimizer"])
    train = loaded["train"]
    if same_plan:
        rng = loaded["rng"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        torch.set_rng_state(train["rng"])
    return {"step": int(train["step"]), "extra": train["extra"], "marker": marker,
            "rng": "per-rank" if same_plan else "rank 0"}
