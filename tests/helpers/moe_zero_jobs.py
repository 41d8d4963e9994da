"""Spawned bodies of ``tests/sync/test_moe_zero.py``: the MoE layouts of ``moe_jobs.layout_run``
with NUTP's distributed optimizer (``train.distributed_optimizer``: experts sliced among each
shard's holders, ``sync/zero.py`` + ``sync/experts.py``), both layouts in one world, plus each
rank's optimizer-state bytes for its experts.

``control='expert_grad_not_reduced'`` (negative control): the holders' reduce-scatter of the
expert gradients is replaced by each holder taking its own slice of its own replica's
(weighted) gradient: every slice is stepped from one replica's share, not the global batch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from .moe_jobs import layout_run
from .moe_reference import MoECase


@contextlib.contextmanager
def _own_slice_only() -> Iterator[None]:
    """``dist.reduce_scatter_tensor`` as a member's own slice of its input (no sum)."""
    import torch.distributed as dist

    real = dist.reduce_scatter_tensor

    def own(out: torch.Tensor, inp: torch.Tensor, group: Any = None, **_: Any) -> None:
        j = dist.get_group_rank(group, dist.get_rank())
        out.copy_(inp[j * out.numel():(j + 1) * out.numel()])

    dist.reduce_scatter_tensor = own  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.reduce_scatter_tensor = real


def _tweak(control: str | None, keep: dict[str, Any]) -> Any:
    def tweak(s: Any) -> None:
        keep["session"] = s
        if control == "expert_grad_not_reduced":
            experts = s.model.nutp_experts
            finish = experts.finish

            def bad(engine: Any) -> None:
                with _own_slice_only():
                    finish(engine)

            experts.finish = bad
    return tweak


def expert_state(s: Any) -> dict[str, int]:
    """This rank's expert elements and the optimizer state it keeps for them (bytes between
    steps: fp32 models keep no masters, Adam's two fp32 moments per element) against what the
    non-distributed optimizer keeps (its moments for every local expert element)."""
    opt = s.optimizer
    local = sum(p.numel() for p in opt.expert_params())
    sliced = sum(seg.z - seg.a for seg in opt.expert_segments)
    per = 4 * len(opt._state_keys()) + (4 if opt.keep_masters else 0)
    return {"local_expert_numel": local, "sliced_expert_numel": sliced,
            "zero_expert_state_bytes": per * sliced, "plain_expert_state_bytes": 8 * local,
            "state_bytes": opt.state_bytes()}


def zero_worker(rank: int, world: int, port: int, case: MoECase,
                runs: list[tuple[tuple[int, ...], str | None]], ref_path: str,
                outdir: str) -> None:
    from tests.helpers.dist import gloo_rank

    def body() -> None:
        import faulthandler

        import torch.distributed as dist

        hang = open(os.path.join(outdir, f"hang_rank{rank}.txt"), "w")
        faulthandler.dump_traceback_later(240.0, exit=True, file=hang)
        ref = torch.load(ref_path, weights_only=False)
        for replicas, control in runs:
            keep: dict[str, Any] = {}
            rec = layout_run(case, replicas, control, ref, zero=True,
                             tweak=_tweak(control, keep))
            stats: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(stats, expert_state(keep["session"]))
            if rec is not None:
                rec["expert_state"] = stats
                name = "_".join(map(str, replicas))
                torch.save(rec, os.path.join(outdir, f"moe_zero_{name}_{control}.pt"))
        faulthandler.cancel_dump_traceback_later()
        hang.close()

    gloo_rank(rank, world, port, outdir, body)


def bridge_zero_worker(rank: int, world: int, port: int, overrides: list[str],
                       control: str | None, outdir: str) -> None:
    """``bridge_moe_jobs.nutp_worker`` (``nutp-bridge`` on the shrunk Qwen3-MoE recipe at
    [2,1]) with ``overrides``; ``control='expert_grad_not_reduced'`` as above (every
    ``ExpertSync`` of this process); writes ``nutp_<control>.json``."""
    from nemo_nutp.sync.experts import ExpertSync

    from .bridge_moe_jobs import nutp_worker

    if control == "expert_grad_not_reduced":
        finish = ExpertSync.finish

        def bad(self: Any, engine: Any) -> None:
            with _own_slice_only():
                finish(self, engine)

        ExpertSync.finish = bad  # type: ignore[method-assign]
    nutp_worker(rank, world, port, overrides, control, outdir)
