"""Atomic, layout-portable checkpoints in megatron-core's own format (``dist_checkpointing``).

Directory conventions (Megatron-LM / Megatron-Bridge) are in ``megatron_format``: ``iter_NNNNNNN/``
under a root, ``latest_checkpointed_iteration.txt`` beside them, NUTP's metadata
(``nutp_checkpoint.json``: step, model dims, plan, per-file sha256) inside, never required.

What is stored (collective ``dist_checkpointing.save`` of one state dict)::

    model          megatron GPTModel keys/shapes (``sharding``), uneven NUTP shards as chunks
    optimizer      megatron's optimizer.sharded_state_dict(model) (keys optimizer.state.*; a MoE
                   model's dense + expert optimizers as stock EP1's one: ``experts``)
    iteration      steps completed (Megatron-LM's key), checkpoint_version 3.0
    nutp_train     step, extra (JSON-able, e.g. the goodput ledger), rank 0's CPU RNG state
    nutp_rng_state every rank's CPU/CUDA RNG state (restored only into the same plan)

Guarantees:
* a save writes into ``iter_N.tmp-XXXX``; every rank hashes the files it wrote (in parallel,
  ``integrity``); rank 0 writes ``nutp_checkpoint.json`` with the union, then *publishes*: an
  existing ``iter_N`` is renamed aside, the new one renamed in, the aside removed; then the
  tracker is replaced. A crash at any point leaves the previous complete copy loadable;
* ``load_checkpoint`` checks model dims (``ValueError`` naming the field), verifies checksums on
  all ranks in parallel (``CheckpointError`` naming the file), and loads NUTP's and stock
  megatron-core checkpoints alike; ``load_optimizer=False`` loads the weights only;
* any plan of the same model loads any checkpoint (global tensors; optimizer state included).

Collective: ``save_checkpoint``, ``load_checkpoint``, ``verify_checkpoint`` and
``load_newest_valid`` must be called by every rank.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..model.te_names import read_back_on_load
from . import integrity
from .bridge_state import align_param_groups
from .experts import load_optimizer_state, optimizer_sharded_state_dict
from .megatron_format import (
    META,
    candidates,
    describe,
    is_complete,
    iter_dir,
    publish,
    read_meta,
    read_tracker,
    restore_asides,
    write_atomic,
    write_tracker,
)
from .sharding import expected_global_shapes, megatron_sharded_state_dict, state_key

if TYPE_CHECKING:
    from ..layout import Plan
    from ..train.session import RankSession

FORMAT = "nemo_nutp.checkpoint/2"
"""NUTP metadata format: 2 = megatron-core GPT keys in ``iter_N`` directories."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or not loadable into this model."""


def _dims(model_cfg: Any) -> dict[str, Any]:
    """The model fields as the checkpoint's JSON marker holds them (tuples as lists: a saved
    ``window_size`` compares equal to the job's)."""
    from ..config.schema import RENAMED

    if dataclasses.is_dataclass(model_cfg) and not isinstance(model_cfg, type):
        out = json.loads(json.dumps(dataclasses.asdict(model_cfg)))
        return {k: v for k, v in out.items() if k not in RENAMED}  # deprecated aliases: None
    return {}


def _plan_summary(plan: Plan) -> dict[str, Any]:
    return {"world_size": plan.world_size, "replica_tp": [list(r.tp) for r in plan.replicas],
            "microbatches": [r.microbatches for r in plan.replicas],
            "rank_to_gpu": list(plan.rank_to_gpu)}


def _model_state(session: RankSession) -> dict[str, Any]:
    ctx = session.groups.ctx
    return megatron_sharded_state_dict(session.gpt, session.model_cfg, replica=ctx.replica,
                                       tp_rank=ctx.tp_rank)


def _rng_states() -> dict[str, Any]:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _rng_object(plan: Plan, data: Any) -> Any:
    """This rank's RNG states as one entry of a per-rank object; only a run with the same plan
    loads it. (Not Megatron-LM's ``rng_state``, whose shape is (pp, tp, dp).)"""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("nutp_rng_state", data, (plan.world_size,), (dist.get_rank(),),
                         replica_id=0)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=integrity.control_group())
    return box[0]


def save_checkpoint(session: RankSession, root: str | Path, *, step: int,
                    extra: dict[str, Any] | None = None, fault: Any = None,
                    hashing: str = "parallel", background: Any = None) -> Path:
    """Save model, optimizer, ``step`` (steps completed = next step to run), RNG and ``extra``
    (JSON-able, taken from rank 0) atomically as ``root/iter_{step:07d}``; returns that path.

    ``background`` (a ``background.BackgroundSaves``): snapshot the state and return; the
    writing, hashing, publishing and tracker update finish in the background (the path exists
    once ``background`` finalised the save; see there). Without it the save is synchronous.
    ``fault`` (tests): run by every rank after its shards are written (with ``background``:
    right after the background write started) and before the checkpoint is published (a crash
    there must leave the previous one valid).
    ``hashing``: 'parallel' (every rank its own files) or 'rank0' (rank 0 reads every file
    after a barrier: the former behaviour, kept for comparison).
    """
    from megatron.core import dist_checkpointing

    from ..common.procs import results_queue_dies_with_rank

    results_queue_dies_with_rank()  # no orphaned helper holds the job's output after a crash
    root = Path(root)
    rank0 = dist.get_rank() == 0
    made: Any = None
    if rank0:  # a failure here is every rank's (no rank is left waiting in a collective)
        try:
            made = root / f"iter_{step:07d}.tmp-{secrets.token_hex(4)}"
            made.mkdir(parents=True)
            restore_asides(root)
        except OSError as e:
            made = f"cannot create a checkpoint directory under {root}: {e}"
    made = _broadcast(made)
    if isinstance(made, str):
        raise CheckpointError(made)
    tmp = Path(made)
    _settle(session.optimizer, "checkpoint")  # a step's deferred parameter gather
    model = _model_state(session)
    state: dict[str, Any] = {"model": model,
                             "optimizer": optimizer_sharded_state_dict(session.optimizer, model)}
    # Identical on every rank (megatron checks the common part for consistency).
    state.update(_broadcast({"iteration": step, "checkpoint_version": 3.0,
                             "nutp_train": {"step": step, "extra": extra or {},
                                            "rng": torch.get_rng_state(),
                                            # the lr schedule's clock is step - skips
                                            "skips": int(getattr(session, "skips", 0))}}
                            if rank0 else None))
    state["nutp_rng_state"] = _rng_object(session.plan, _rng_states())
    final = iter_dir(root, step)
    meta = {"format": FORMAT, "step": step, "model": _dims(session.model_cfg),
            "plan": _plan_summary(session.plan), "rng_per_rank": True}
    shapes = _my_global_shapes(session)
    if background is not None:
        request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True,
                                          **_mcore_async())
        background.schedule(request, tmp, final, step,
                            lambda digests: _publish(tmp, final, step, meta, shapes, digests))
        if fault is not None:
            fault()
        return final
    dist_checkpointing.save(state, str(tmp))
    if fault is not None:
        fault()
    if hashing == "parallel":
        mine = integrity.hash_own_files(tmp, dist.get_rank())
    else:
        dist.barrier(group=integrity.control_group())
        mine = integrity.checksums_serial(tmp, skip=(META,)) if rank0 else {}
    _publish(tmp, final, step, meta, shapes, mine)
    return final


def _mcore_async() -> dict[str, Any]:
    """megatron-core >= 0.17 picks an async implementation (default ``nvrx``, which needs
    nvidia-resiliency-ext); NUTP uses megatron's own (``mcore``: ``AsyncCallsQueue``)."""
    import inspect

    from megatron.core import dist_checkpointing

    params = inspect.signature(dist_checkpointing.save).parameters
    return {"async_strategy": "mcore"} if "async_strategy" in params else {}


def _publish(tmp: Path, final: Path, step: int, meta: dict[str, Any],
             shapes: dict[str, list[int]] | None, digests: dict[str, str]) -> None:
    """Collective: every rank sends rank 0 its files' digests and sizes (and, for one rank per
    pipeline stage, its keys' global shapes) in one ``gather_object`` on the control group;
    rank 0 writes ``nutp_checkpoint.json``, publishes ``tmp`` as ``final`` and replaces the
    tracker; a barrier ends it. No rank lists the directory."""
    sizes = {n: (tmp / n).stat().st_size for n in digests}
    box = integrity.gather_to_rank0({"files": digests, "sizes": sizes, "shapes": shapes})
    if box is not None:
        files: dict[str, str] = {}
        all_sizes: dict[str, int] = {}
        all_shapes: dict[str, list[int]] = {}
        for part in box:
            files.update(part["files"])
            all_sizes.update(part["sizes"])
            all_shapes.update(part["shapes"] or {})
        full = {**meta, "global_shapes": all_shapes, "files": dict(sorted(files.items())),
                "sizes": dict(sorted(all_sizes.items()))}
        write_atomic(tmp / META, json_dumps(full))
        publish(tmp, final)
        write_tracker(final.parent, step)
    dist.barrier(group=integrity.control_group())


def _my_global_shapes(session: RankSession) -> dict[str, list[int]] | None:
    """This rank's keys' global shapes if it speaks for its pipeline stage (replica 0, TP rank
    0: each stage holds other keys), else None."""
    ctx = session.groups.ctx
    return (expected_global_shapes(session.gpt, session.model_cfg)
            if ctx.replica == 0 and ctx.tp_rank == 0 else None)


def json_dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=1)


def read_marker(path: Path) -> dict[str, Any] | None:
    """NUTP's metadata of a *complete* checkpoint (None otherwise, or if not saved by NUTP)."""
    path = Path(path)
    return read_meta(path) if is_complete(path) else None


def find_latest(root: str | Path) -> Path | None:
    """The checkpoint the loader tries first under ``root`` (the tracker's; see
    ``megatron_format.candidates``), None if there is none. Pure filesystem, no verification."""
    found = candidates(Path(root))
    return found[0] if found else None


def latest_step(root: str | Path | None) -> int | None:
    """Step of the tracker's complete checkpoint (None if none): pure filesystem."""
    if root is None:
        return None
    step = read_tracker(Path(root))
    if step is None:
        return None
    found = [p for p in candidates(Path(root), warn=False) if _step_of(p) == step]
    return step if found else None


def _step_of(path: Path) -> int | None:
    from .megatron_format import step_of

    return step_of(path)


def check_compatible(marker: dict[str, Any], model_cfg: Any, path: Path) -> None:
    """Model dims of an NUTP checkpoint must equal the job's: ``ValueError`` naming the field."""
    if not str(marker.get("format", "")).startswith("nemo_nutp.checkpoint/"):
        raise CheckpointError(f"{path}: format {marker.get('format')!r}, expected {FORMAT!r}")
    from ..config.schema import RENAMED

    mine = _dims(model_cfg)
    saved = dict(marker.get("model", {}))
    for old, new in RENAMED.items():  # a previous release's marker holds the old names
        value = saved.pop(old, None)
        if value is not None and new not in saved:
            saved[new] = value
    for key, value in mine.items():
        if key in saved and saved[key] != value:
            raise ValueError(f"model.{key}={value!r}: checkpoint {path} was saved with "
                             f"model.{key}={saved[key]!r}")


def check_shapes(path: Path, expected: dict[str, list[int]]) -> bool:
    """Every model key of this job is in the checkpoint with its global shape (any saver,
    stock megatron-core included); returns whether optimizer state is present."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    for key, shape in expected.items():
        if key not in meta:
            have = sorted(k for k in meta if not k.startswith("optimizer."))[:6]
            raise CheckpointError(f"checkpoint {path} has no tensor {key!r} (not this model? "
                                  f"it holds {have} ...)")
        if list(meta[key].global_shape) != list(shape):
            raise CheckpointError(f"checkpoint {path}: {key} has global shape "
                                  f"{list(meta[key].global_shape)}, this model {shape}")
    return any(k.startswith("optimizer.state.") for k in meta)


def _check_recorded_shapes(saved: dict[str, list[int]], expected: dict[str, list[int]],
                           path: Path) -> None:
    for key, shape in expected.items():
        if saved.get(key) != shape:
            raise CheckpointError(f"checkpoint {path}: {key} has global shape "
                                  f"{saved.get(key)}, this model {shape}")


def check_dims_of_megatron_checkpoint(path: Path, model_cfg: Any) -> None:
    """A checkpoint without NUTP metadata (e.g. stock megatron's) against the job's model
    dims, from its tensor metadata alone (no process group): ``ValueError`` naming the field."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    m = model_cfg
    checks = [("embedding.word_embeddings.weight", 0, "vocab_size", m.vocab_size),
              ("embedding.word_embeddings.weight", 1, "hidden_size", m.hidden_size),
              ("decoder.layers.mlp.linear_fc2.weight", 0, "num_layers", m.num_layers),
              ("decoder.layers.mlp.linear_fc2.weight", 2, "ffn_hidden_size",
               m.ffn_hidden_size)]
    for key, axis, field, value in checks:
        if key not in meta:
            raise CheckpointError(f"checkpoint {path} has no tensor {key!r}: not a megatron-core "
                                  "GPT checkpoint")
        saved = int(meta[key].global_shape[axis])
        if saved != value:
            raise ValueError(f"model.{field}={value!r}: checkpoint {path} was saved with "
                             f"model.{field}={saved!r}")


def verify_files(marker: dict[str, Any], path: Path) -> None:
    """One-process check of every checksum (tools, tests)."""
    bad = integrity.verify_serial(marker["files"], Path(path))
    if bad:
        raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(bad)}")


def verify_checkpoint(path: Path, marker: dict[str, Any] | None) -> str | None:
    """All ranks check the checksums together (each its share); the problem or None, the same
    on every rank. Stock megatron checkpoints carry no checksums: completeness only."""
    if not is_complete(path):
        return f"checkpoint {path} is incomplete ({describe(path)})"
    if marker is None or "files" not in marker:
        return None
    bad = integrity.verify_parallel(marker["files"], path, marker.get("sizes"))
    return f"checkpoint {path} is corrupt: {'; '.join(bad)}" if bad else None


def load_checkpoint(session: RankSession, path: str | Path, *, verify: bool = True,
                    load_optimizer: bool = True) -> dict[str, Any]:
    """Load one checkpoint (NUTP's or stock megatron-core's) into ``session`` (any layout).

    Returns ``{"step", "saved_step", "extra", "marker", "rng", "optimizer", "weights_only"}``.
    Full load: model, optimizer (when the checkpoint has one) and the saved step.
    ``load_optimizer=False`` (weights only): the model; the optimizer stays fresh and ``step``
    is 0. Raises before touching the model if the checkpoint
    is incomplete, corrupt or of another model."""
    path = Path(path)
    marker = read_meta(path)
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path}: not a complete checkpoint ({describe(path)})")
    expected = expected_global_shapes(session.gpt, session.model_cfg)
    if marker is not None and "global_shapes" in marker:  # NUTP's: no metadata read needed
        check_compatible(marker, session.model_cfg, path)
        _check_recorded_shapes(marker["global_shapes"], expected, path)
        has_optim = True
    else:
        has_optim = check_shapes(path, expected)
    if verify:
        problem = verify_checkpoint(path, marker)
        if problem:
            raise CheckpointError(problem)
    info = _load(session, path, marker, load_optimizer=load_optimizer and has_optim)
    info["weights_only"] = not load_optimizer
    info["step"] = info["saved_step"] if load_optimizer else 0
    return info


def _load(session: RankSession, path: Path, marker: dict[str, Any] | None, *,
          load_optimizer: bool) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    _settle(session.optimizer, "load", publish=False)  # the parameters are about to be loaded
    model = _model_state(session)
    # Extra state is not read back (model/te_names.py: local <-> TE checkpoints interchange).
    state: dict[str, Any] = {"model": {k: v for k, v in model.items() if read_back_on_load(k)}}
    if load_optimizer:
        state["optimizer"] = optimizer_sharded_state_dict(session.optimizer, model,
                                                          is_loading=True)
    # Per-rank RNG states come back only into the same plan (rank r is the same GPU and role);
    # another NUTP layout gets the saver's rank 0 CPU state on every rank; stock checkpoints
    # leave the RNG as it is.
    same_plan = (marker is not None and marker.get("rng_per_rank", False)
                 and marker.get("plan") == _plan_summary(session.plan))
    if same_plan:
        state["nutp_rng_state"] = _rng_object(session.plan, None)
    loaded = dist_checkpointing.load(state, str(path))
    with torch.no_grad():
        for name, p in session.gpt.named_parameters():
            p.copy_(loaded["model"][state_key(name)].view_as(p))
    if load_optimizer:
        # A Bridge / Megatron-LM optimizer's groups carry its scheduler's keys (bridge_state)
        align_param_groups(list(session.optimizer.param_groups), loaded["optimizer"])
        load_optimizer_state(session.optimizer, loaded["optimizer"])
    else:
        _refresh_master_weights(session.optimizer)
    train = loaded.get("nutp_train")
    rng = "unchanged"
    if same_plan:
        saved = loaded["nutp_rng_state"]
        torch.set_rng_state(saved["cpu"])
        if saved["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
        rng = "per-rank"
    elif train is not None:
        torch.set_rng_state(train["rng"])
        rng = "rank 0"
    step = int(train["step"]) if train is not None else int(loaded.get("iteration", 0))
    if load_optimizer and hasattr(session, "skips"):  # the schedule continues (weights only:
        # it starts over, as the optimizer does)
        session.skips = int(train.get("skips", 0)) if train is not None else 0
        session.counted_through = step - 1
    return {"step": step, "saved_step": step, "extra": train["extra"] if train else {},
            "marker": marker, "rng": rng, "optimizer": load_optimizer}


def _settle(optimizer: Any, where: str, *, publish: bool = True) -> None:
    """NUTP's distributed optimizer with ``overlap_param_gather``: complete the parameter
    all-gathers its last step launched before the parameters are read or overwritten
    (``sync/zero.py``, ``settle``; collective). Other optimizers: nothing."""
    settle = getattr(optimizer, "settle", None)
    if settle is not None:
        settle(where, publish=publish)


def _refresh_master_weights(optimizer: Any) -> None:
    """Weights only: megatron's mixed-precision optimizer keeps fp32 master copies of the
    (just overwritten) half-precision params; copy them over (fp32: nothing to do). NUTP's
    distributed optimizer (``sync/zero.py``) takes its slices of them (collective)."""
    if getattr(optimizer, "nutp_zero", False):
        optimizer.reload_model_params()
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(inner, "float16_groups", None)
        masters = getattr(inner, "fp32_from_float16_groups", None)
        if groups is None or masters is None:
            continue
        with torch.no_grad():
            for g16, g32 in zip(groups, masters, strict=True):
                for p16, p32 in zip(g16, g32, strict=True):
                    p32.copy_(p16.float())


def load_newest_valid(session: RankSession, paths: list[Path], *, strict: bool = False,
                      load_optimizer: bool = True, warn: Any = None) -> dict[str, Any] | None:
    """Load the first of ``paths`` (the loader's order) that passes verification. A failing
    one is skipped with a loud warning (``warn(msg)`` on rank 0, and ``warnings.warn``), or
    with ``strict`` raises ``CheckpointError``. None if none passes (after warnings)."""
    for k, path in enumerate(paths):
        marker = read_meta(path)
        problem = verify_checkpoint(path, marker)
        if problem is None:
            info = load_checkpoint(session, path, verify=False, load_optimizer=load_optimizer)
            info["path"] = path
            info["skipped"] = [str(p) for p in paths[:k]]
            return info
        if strict:
            raise CheckpointError(f"{problem} (checkpoint.strict=true: no fallback)")
        msg = (f"WARNING: {problem}; falling back to "
               f"{paths[k + 1] if k + 1 < len(paths) else 'nothing (no older checkpoint)'}")
        if dist.get_rank() == 0:
            warnings.warn(msg, stacklevel=2)
            if warn is not None:
                warn(msg)
    return None
