"""Evaluation during training under Bridge's own ``train()`` (its ``eval.evaluate``), exact.

Bridge's ``evaluate`` runs, per evaluation iteration, ``eval_global_batch_size //
(eval_micro_batch_size x pg_collection.dp.size())`` forward-only micro-batches on every rank
and all-reduces each reported ``(loss sum, tokens)`` over ``pg_collection.dp_cp``; the printed
validation loss is the ratio of the sums. Under NUTP ``dp`` and ``dp_cp`` hold every rank of a
stage (every TP rank of every replica), and a replica runs its share of the global batch, not
``1/dp`` of it. So:
- each replica reads its share of every validation global batch
  (``bridge_data.valid_iterator``: the training shares);
- for the duration of an evaluation, ``validation.eval_global_batch_size`` is the value that
  makes Bridge's count this replica's share (``share x eval_micro_batch_size x dp.size()``),
  and ``train_state.consumed_valid_samples`` still advances by the true global batch at every
  evaluation iteration (``eval_callbacks``: Bridge's ``on_eval_*`` callback events, before it
  reads the batch size, before it adds the samples, after it has divided the sums);
- each reported ``(loss sum, tokens)`` is scaled by ``1/degree`` (``bridge_run.recording``),
  so that the sum over ``dp_cp`` counts every sample once.
Then Bridge's validation loss is one process's over the same validation global batches.
If Bridge's time limit (``train.exit_duration_in_mins``) ends an evaluation early, its
``on_eval_end`` does not fire: the batch size is left at this replica's value while the run
exits (the samples counted are right).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def eval_callbacks(cfg: Any, state: Any, *, share: int, dp_size: int,
                   record: list[dict[str, float]],
                   shared: Callable[[float], float] | None = None) -> Any:
    """Bridge's ``CallbackManager`` with the NUTP evaluation hooks (module docstring); each
    evaluation appends ``{"step", "val_loss"}`` (Bridge's own reduced ``lm loss``, what it
    prints) to ``record``. With pipeline stages only the last stage has it (NaN elsewhere):
    ``shared`` (collective over the replica) gives every rank the last stage's value."""
    from megatron.bridge.training.callbacks import CallbackManager

    v = cfg.validation
    true_batch = v.eval_global_batch_size
    mine = share * v.eval_micro_batch_size * dp_size

    def start(ctx: Any) -> None:
        v.eval_global_batch_size = mine  # Bridge reads it right after this event

    def step_end(ctx: Any) -> None:
        # Bridge adds eval_global_batch_size (here this replica's value) right after this
        state.train_state.consumed_valid_samples += true_batch - mine

    def end(ctx: Any) -> None:
        v.eval_global_batch_size = true_batch
        losses = ctx.total_loss_dict
        val = float(losses["lm loss"]) if "lm loss" in losses else float("nan")
        if shared is not None:
            val = shared(val)
        record.append({"step": int(state.train_state.step), "val_loss": val})

    manager = CallbackManager()
    manager.register("on_eval_start", start)
    manager.register("on_eval_step_end", step_end)
    manager.register("on_eval_end", end)
    return manager
