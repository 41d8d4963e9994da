"""Data: deterministic synthetic token stream and per-replica micro-batch slicing."""

from .synthetic import MicroBatch, replica_microbatches, synthetic_microbatch

__all__ = ["MicroBatch", "replica_microbatches", "synthetic_microbatch"]
