"""Layout-portable, atomic checkpoints in megatron-core's format (``dist_checkpointing``).

The names below load on first use: light submodules (``events``, ``interval``) are imported by
processes that never touch a checkpoint (the control process, node agents, the watchdog), and
the package itself must not pull in torch and megatron-core for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sharding import megatron_sharded_state_dict
    from .store import (
        CheckpointError,
        find_latest,
        latest_step,
        load_checkpoint,
        load_newest_valid,
        save_checkpoint,
    )

_WHERE = {"megatron_sharded_state_dict": ".sharding", "CheckpointError": ".store",
          "find_latest": ".store", "latest_step": ".store", "load_checkpoint": ".store",
          "load_newest_valid": ".store", "save_checkpoint": ".store"}

__all__ = ["CheckpointError", "find_latest", "latest_step", "load_checkpoint",
           "load_newest_valid", "megatron_sharded_state_dict", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
