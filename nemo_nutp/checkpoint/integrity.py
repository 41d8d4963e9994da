"""Checksums that scale: every rank hashes what it wrote; loads verify in parallel.

* ``hash_own_files(directory, rank)``: sha256 of the files ``rank`` wrote in a torch_dist save
  (``__{rank}_{k}.distcp`` for ``k`` below the strategy's writer count, found by name, never by
  listing the directory, which holds O(world) files; rank 0 also the small ``common.pt``,
  ``metadata.json``, ``.metadata``), on a thread pool (hashlib releases the GIL on large
  buffers, so files hash concurrently). ``gather_checksums`` collects them on rank 0 (one
  ``gather_object`` on the control group): rank 0's busy time is its own shards, not the whole
  checkpoint.
* ``verify_parallel(files, directory)``: the files are split among the ranks by size
  (largest first onto the least loaded rank, the same split on every rank), each rank checks its
  share on a thread pool, and every rank gets the same list of problems.
* ``checksums_serial`` / ``verify_serial``: one process reads everything (tools, tests, and the
  benchmark's "before" column).

Collective functions (``gather_checksums``, ``verify_parallel``) must be called by every rank.
"""

from __future__ import annotations

import hashlib
import heapq
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

CHUNK = 8 << 20
SMALL = 4 << 20  # bytes below which files are hashed inline
RANK0_FILES = ("common.pt", "metadata.json", ".metadata")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _threads(n: int) -> int:
    return max(1, min(n, os.cpu_count() or 1, 8))


def hash_files(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: sha256}`` of ``names`` under ``directory``, hashed concurrently."""
    names = sorted(names)
    if len(names) <= 1 or sum((directory / n).stat().st_size for n in names) < SMALL:
        return {n: sha256_file(directory / n) for n in names}  # a pool costs more than it saves
    with ThreadPoolExecutor(_threads(len(names))) as pool:
        digests = list(pool.map(lambda n: sha256_file(directory / n), names))
    return dict(zip(names, digests, strict=True))


WRITERS = 2
"""Files per rank of a torch_dist save: megatron's ``TorchDistSaveShardedStrategy``
``thread_count`` (default 2; ``FileSystemWriterAsync`` names them ``__{rank}_{k}.distcp``)."""


def shard_names(rank: int, *, rank0_files: bool = True) -> list[str]:
    """Names ``rank`` may have written (a few stats, whatever the world size)."""
    names = [f"__{rank}_{k}.distcp" for k in range(WRITERS)]
    return names + (list(RANK0_FILES) if rank == 0 and rank0_files else [])


def own_files(directory: Path, rank: int, *, rank0_files: bool = True) -> list[str]:
    """Names of the files ``rank`` wrote in a torch_dist save under ``directory`` (by name)."""
    return [n for n in shard_names(rank, rank0_files=rank0_files) if (directory / n).is_file()]


def hash_own_files(directory: Path, rank: int, *, rank0_files: bool = True) -> dict[str, str]:
    return hash_files(directory, own_files(directory, rank, rank0_files=rank0_files))


def control_group() -> Any:
    """The process group for checkpoint object collectives and barriers: the default group
    under gloo, else one gloo group over all ranks (created once, collectively, on first use:
    object collectives on NCCL pickle to device tensors and serialise per rank).

    The one process-wide cache of the package, like megatron's ``parallel_state`` groups: it
    belongs to the current default group, and the backend adapter that leaves a world
    (``live.backend.abandon``) clears it. A ProcessGroup takes no attributes, so it cannot
    live on the group itself."""
    global _CONTROL
    if _CONTROL is None:
        _CONTROL = (dist.group.WORLD if dist.get_backend() == "gloo"
                    else dist.new_group(backend="gloo"))
    return _CONTROL


_CONTROL: Any = None


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """``obj`` of every rank on rank 0 (None elsewhere), over ``control_group``. Collective.
    Rank 0 receives one small object per rank; the others send one."""
    group = control_group()
    box: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, box, dst=0, group=group)
    return box


def gather_checksums(directory: Path) -> dict[str, str] | None:
    """Every rank hashes its own files; rank 0 gets the union (others: None). Collective."""
    box = gather_to_rank0(hash_own_files(directory, dist.get_rank()))
    if box is None:
        return None
    out: dict[str, str] = {}
    for part in box:
        out.update(part or {})
    return dict(sorted(out.items()))


def checksums_serial(directory: Path, *, skip: Iterable[str] = ()) -> dict[str, str]:
    """One reader hashes every file under ``directory`` (recursively), one after another."""
    skip = set(skip)
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in skip:
            out[str(p.relative_to(directory))] = sha256_file(p)
    return out


def split_by_size(files: dict[str, int], parts: int) -> list[list[str]]:
    """Deterministic longest-processing-time split of ``{name: bytes}`` into ``parts``."""
    heap = [(0, k) for k in range(parts)]
    out: list[list[str]] = [[] for _ in range(parts)]
    for name in sorted(files, key=lambda n: (-files[n], n)):
        load, k = heapq.heappop(heap)
        out[k].append(name)
        heapq.heappush(heap, (load + files[name], k))
    return out


def problems(expected: dict[str, str], directory: Path, names: Iterable[str]) -> list[str]:
    """What is wrong with ``names`` (missing file, checksum differs)."""
    names = list(names)
    missing = [n for n in names if not (directory / n).is_file()]
    found = hash_files(directory, [n for n in names if n not in missing])
    out = [f"file {n} is missing" for n in missing]
    out += [f"checksum of {n} differs" for n, d in found.items() if d != expected[n]]
    return out


def verify_serial(expected: dict[str, str], directory: Path) -> list[str]:
    return problems(expected, directory, expected)


def verify_parallel(expected: dict[str, str], directory: Path,
                    sizes: dict[str, int] | None = None) -> list[str]:
    """Problems found by all ranks together (the same sorted list on every rank). Collective.

    ``sizes`` (recorded at save time) splits the work without a stat per file on every rank;
    without it (older checkpoints) every rank stats every file. One integer all-reduce tells
    whether any rank found a problem; only then are the problems gathered and broadcast."""
    import torch

    if sizes is None or set(sizes) != set(expected):
        sizes = {}
        for n in expected:
            try:
                sizes[n] = (directory / n).stat().st_size
            except OSError:
                sizes[n] = 0
    share = split_by_size(sizes, dist.get_world_size())[dist.get_rank()]
    mine = problems(expected, directory, share)
    group = control_group()
    count = torch.tensor([len(mine)], dtype=torch.int64)
    dist.all_reduce(count, group=group)
    if int(count.item()) == 0:
        return []
    box = gather_to_rank0(mine)
    found = [sorted(p for part in box for p in (part or []))] if box is not None else [None]
    dist.broadcast_object_list(found, src=0, group=group)
    return list(found[0] or [])
