"""Layout-portable, atomic checkpoints in megatron-core's format (``dist_checkpointing``)."""

from .sharding import megatron_sharded_state_dict
from .store import (
    CheckpointError,
    find_latest,
    latest_step,
    load_checkpoint,
    load_newest_valid,
    save_checkpoint,
)

__all__ = ["CheckpointError", "find_latest", "latest_step", "load_checkpoint",
           "load_newest_valid", "megatron_sharded_state_dict", "save_checkpoint"]
