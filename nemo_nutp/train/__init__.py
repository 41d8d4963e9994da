"""Training: optimizer set-up and the NUTP train step (micro-batches, sync, update)."""

from .step import StepResult, build_optimizer, reduce_replica_loss, train_step

__all__ = ["StepResult", "build_optimizer", "reduce_replica_loss", "train_step"]
