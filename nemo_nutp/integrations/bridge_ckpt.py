"""Bridge's checkpoint manager for NUTP runs: Bridge's loop decides when, NUTP's store writes.

Bridge's ``train()`` takes a ``CheckpointManager`` (``megatron/bridge/training/checkpointing.py``:
``save(ctx, callback_manager)``, ``load(ctx)``, ``finalize_async_saves``) and calls ``save`` at
``checkpoint.save_interval`` steps and at the end. Bridge's default manager writes
``GPTModel.sharded_state_dict()`` of the model it is given, whose equal-chunk TP split cannot
describe NUTP's uneven shards; this one hands the same moment to ``nemo_nutp.checkpoint``:
megatron-core's format (the keys, global shapes and dtypes of stock ``GPTModel`` and megatron's
optimizer), ``iter_NNNNNNN`` + ``latest_checkpointed_iteration.txt`` under ``checkpoint.save``,
atomic (temp name, then rename), checksummed. So ``nutp-train`` resumes it in any layout, and a
stock megatron-core ``GPTModel`` loads it with ``dist_checkpointing.load``. Bridge's own extra
state (consumed samples, the lr/weight-decay scheduler) rides along in the metadata
(``extra["bridge"]``): ``nutp-train``'s resume checks that schedule against its constant
``train.lr`` / ``train.weight_decay`` at every step it will run, and pairs Bridge's optimizer
parameter groups with its own (``nemo_nutp/checkpoint/bridge_state.py``).
"""

from __future__ import annotations

from typing import Any


class NUTPBridgeCheckpointManager:
    """``CheckpointManager`` of one rank of an NUTP run (built by ``bridge_run.train_rank``)."""

    def __init__(self, checkpoint_config: Any, *, plan: Any, groups: Any) -> None:
        self.checkpoint_config = checkpoint_config
        self.plan, self.groups = plan, groups
        self._context: dict[str, Any] = {}
        self.saved: list[str] = []

    @property
    def checkpointing_context(self) -> dict[str, Any]:
        return self._context

    def save(self, ctx: Any, callback_manager: Any = None) -> None:
        from ..checkpoint.store import save_checkpoint

        root = self.checkpoint_config.save
        if root is None:
            return
        ts = ctx.state.train_state
        extra = {"bridge": {"consumed_train_samples": int(ts.consumed_train_samples),
                            "scheduler": _jsonable(ctx.opt_param_scheduler.state_dict())
                            if ctx.opt_param_scheduler is not None else None}}
        session = session_of(ctx.model[0], self.plan, self.groups, ctx.optimizer)
        self.saved.append(str(save_checkpoint(session, root, step=int(ts.step), extra=extra)))

    def load(self, ctx: Any) -> tuple[int, int]:
        raise NotImplementedError("nutp-bridge does not resume Bridge runs yet: resume the "
                                  "checkpoint with nutp-train (checkpoint.load_dir=...)")

    def finalize_async_saves(self, state: Any, blocking: bool = False,
                             terminate: bool = False) -> None:
        return None  # saves are synchronous


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def session_of(model: Any, plan: Any, groups: Any, optimizer: Any) -> Any:
    """The view of this rank that ``nemo_nutp.checkpoint`` saves and loads."""
    from types import SimpleNamespace

    return SimpleNamespace(gpt=model.module, model_cfg=plan.request.model, groups=groups,
                           plan=plan, optimizer=optimizer, model=model)
