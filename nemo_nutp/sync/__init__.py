"""Cross-replica gradient synchronisation (reshard, weighted reduction, reshard back)."""

from .ddp import NUTPBucketGroup, NUTPDistributedDataParallel
from .engine import GradSyncEngine

__all__ = ["GradSyncEngine", "NUTPBucketGroup", "NUTPDistributedDataParallel"]
