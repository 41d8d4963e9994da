"""Layout-portable, atomic checkpoints (megatron-core ``dist_checkpointing``, global tensors)."""

from .sharding import chunk_of, model_sharded_state_dict
from .store import CheckpointError, find_latest, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "chunk_of", "find_latest", "load_checkpoint",
           "model_sharded_state_dict", "save_checkpoint"]
