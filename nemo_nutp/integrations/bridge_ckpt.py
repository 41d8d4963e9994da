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
parameter groups with its own (``nemo_nutp/checkpoint/bridge_state.py``). ``nutp-bridge`` itself
resumes it (``load``), in any layout, from that metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class NUTPBridgeCheckpointManager:
    """``CheckpointManager`` of one rank of an NUTP run (built by ``bridge_run.train_rank``)."""

    def __init__(self, checkpoint_config: Any, *, plan: Any, groups: Any) -> None:
        self.checkpoint_config = checkpoint_config
        self.plan, self.groups = plan, groups
        self._context: dict[str, Any] = {}
        self.saved: list[str] = []
        self.loaded: str | None = None

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
                            "consumed_valid_samples": int(ts.consumed_valid_samples),
                            "scheduler": _jsonable(ctx.opt_param_scheduler.state_dict())
                            if ctx.opt_param_scheduler is not None else None}}
        session = session_of(ctx.model[0], self.plan, self.groups, ctx.optimizer)
        self.saved.append(str(save_checkpoint(session, root, step=int(ts.step), extra=extra)))

    def load(self, ctx: Any) -> tuple[int, int]:
        """Bridge's resume (``CheckpointLoadContext``; its ``setup()`` would call this).

        The checkpoint under ``checkpoint.load`` (the tracker's, or ``iter_<ckpt_step>``), saved
        in any NUTP layout or by stock megatron-core, goes into this rank's model and optimizer
        (``checkpoint.load_optim=false`` is refused by the field audit). Bridge's train state
        (step, consumed training and validation samples) and its scheduler's state come from
        the saver's metadata, so a decaying schedule and the data continue where they stopped.
        With no checkpoint there, training starts at step 0, as Bridge's does
        (``checkpoint.exit_on_missing_checkpoint``: an error instead). Returns
        ``(iteration, 0)``: the FLOP counter is not carried. Collective."""
        from ..checkpoint.store import load_checkpoint

        path = self.resume_path()
        if path is None:
            return 0, 0
        session = session_of(ctx.model[0], self.plan, self.groups, ctx.optimizer)
        info = load_checkpoint(session, path)
        step = int(info["saved_step"])
        bridge = (info.get("extra") or {}).get("bridge") or {}
        ts = ctx.state.train_state
        gbs = int(ctx.state.cfg.train.global_batch_size)
        ts.step = step
        ts.consumed_train_samples = int(bridge.get("consumed_train_samples", step * gbs))
        # where the validation stream continues (Bridge's loader starts there)
        ts.consumed_valid_samples = int(bridge.get("consumed_valid_samples", 0))
        sched = ctx.opt_param_scheduler
        if sched is not None:
            saved = bridge.get("scheduler")
            if saved is not None:
                sched.load_state_dict(saved)
            else:  # nutp-train's or stock megatron's checkpoint: Bridge's own clock, in samples
                sched.step(increment=step * gbs)
        self.loaded = str(path)
        return step, 0

    def resume_path(self) -> Path | None:
        """The checkpoint ``load`` reads (None: start at step 0); one-line ``ValueError``
        naming the field when ``checkpoint.ckpt_step`` is missing there, or nothing is there
        with ``checkpoint.exit_on_missing_checkpoint``."""
        from ..checkpoint.store import find_latest

        cfg = self.checkpoint_config
        root = getattr(cfg, "load", None)
        if root is None:
            return None
        step = getattr(cfg, "ckpt_step", None)
        if step is not None:
            chosen = Path(root) / f"iter_{int(step):07d}"
            if not chosen.is_dir():
                raise ValueError(f"checkpoint.ckpt_step={step}: no checkpoint {chosen}")
            return chosen
        latest = find_latest(root)
        if latest is None and getattr(cfg, "exit_on_missing_checkpoint", False):
            raise ValueError(f"checkpoint.load={root}: no checkpoint there "
                             "(checkpoint.exit_on_missing_checkpoint=true)")
        return latest

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

    from megatron.core.transformer.module import Float16Module

    model = getattr(model, "nutp_ddp", model)  # virtual stages: Bridge's chunk views
    gpt = model.module
    if isinstance(gpt, Float16Module):  # bf16/fp16: Bridge's wrapper around the NUTP GPT
        gpt = gpt.module
    return SimpleNamespace(gpt=gpt, model_cfg=plan.request.model, groups=groups,
                           plan=plan, optimizer=optimizer, model=model)
