"""One spawned world for ``test_integrity``: saves, a re-save, a corrupted newest checkpoint.

Layout TP2 (two ranks, so hashing and verification are split between ranks). Trains 4 steps
saving at 2 and 4, re-saves step 4 (atomic swap), corrupts one shard file of step 4, then loads
with ``strict`` (must fail on every rank) and without (must fall back to step 2 with a warning
and continue exactly as the uninterrupted run did). Results go to ``integrity.pt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _corrupt(path: Path) -> str:
    victim = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim.name


def integrity_job(out: str) -> None:
    import torch
    import torch.distributed as dist

    from nemo_nutp.checkpoint import CheckpointError, load_newest_valid, save_checkpoint
    from nemo_nutp.checkpoint.integrity import checksums_serial
    from nemo_nutp.checkpoint.megatron_format import META, candidates, iter_dir, read_meta

    from .roundtrip import Job, _session

    rank0 = dist.get_rank() == 0
    root = Path(out) / "ck"
    res: dict[str, Any] = {}
    s = _session(Job("tp2", (2,)))
    losses = []
    for k in range(4):
        losses.append(s.step(k).loss)
        if (k + 1) % 2 == 0:
            save_checkpoint(s, root, step=k + 1)
    res["losses"] = losses
    d4 = iter_dir(root, 4)
    meta = read_meta(d4)
    assert meta is not None
    res["rank_hashes_equal_serial"] = meta["files"] == checksums_serial(d4, skip=(META,))
    res["files"] = sorted(meta["files"])
    save_checkpoint(s, root, step=4)  # re-save: rename aside, swap, drop the aside
    res["after_resave"] = sorted(p.name for p in root.iterdir())
    dist.barrier()
    if rank0:
        res["corrupted"] = _corrupt(d4)
    dist.barrier()
    s2 = _session(Job("tp2", (2,)))
    try:
        load_newest_valid(s2, candidates(root), strict=True)
        strict = "loaded"
    except CheckpointError as e:
        strict = str(e)
    res["strict"] = strict
    said: list[str] = []
    info = load_newest_valid(s2, candidates(root), warn=said.append)
    assert info is not None
    res["fallback"] = {"path": info["path"].name, "skipped": info["skipped"],
                       "step": info["step"], "said": said}
    res["resumed"] = [s2.step(k).loss for k in range(info["step"], 4)]
    res["hooks"] = _through_hooks(root)
    all_strict = [None] * dist.get_world_size()
    dist.all_gather_object(all_strict, strict)
    res["strict_every_rank"] = all_strict
    if rank0:
        torch.save(res, os.path.join(out, "integrity.pt"))
    dist.barrier()


def _through_hooks(root: Path) -> dict[str, Any]:
    """What the training loop does: ``CheckpointHooks.resume`` (candidates, fallback, the
    console lines) with ``checkpoint.resume=required``."""
    import contextlib
    import io
    from types import SimpleNamespace

    from nemo_nutp.checkpoint.hooks import CheckpointHooks

    from .roundtrip import Job, _session

    ck = SimpleNamespace(resume="required", load_dir=None, strict=False, load_optimizer=True,
                         interval=0)
    cfg = SimpleNamespace(checkpoint=ck, checkpoint_dir=str(root),
                          recovery=SimpleNamespace(fault=SimpleNamespace(kind=None), faults=[]))
    ledger = SimpleNamespace(totals={}, wall_s=0.0, add_pause=lambda *a: None)
    s = _session(Job("tp2", (2,)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        start = CheckpointHooks(cfg, s).resume(ledger)
    return {"start": start, "printed": out.getvalue().splitlines()}


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    gloo_rank(rank, world, port, outdir, lambda: integrity_job(outdir))
