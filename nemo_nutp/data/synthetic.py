"""Deterministic synthetic data, addressed by (seed, step, global micro-batch index).

The global batch of a step is micro-batches ``0..M-1``; replica ``r`` takes the contiguous slice
``[offset_r, offset_r + m_r)`` given by the plan, so the union over replicas is exactly the batch
a single-process run sees, whatever the layout. Sequences follow a noisy affine recurrence
``x[i+1] = (a * x[i] + c) mod V`` (per-sequence a, c), so a model can learn them and the loss
falls.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s]


def synthetic_microbatch(*, seed: int, step: int, index: int, micro_batch_size: int,
                         seq_length: int, vocab_size: int, noise: float = 0.1) -> MicroBatch:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{step}:{index}".encode()))
    b, s, v = micro_batch_size, seq_length + 1, vocab_size
    a = torch.randint(1, 4, (b, 1), generator=gen)
    c = torch.randint(0, v, (b, 1), generator=gen)
    x = torch.empty(b, s, dtype=torch.int64)
    x[:, 0] = torch.randint(0, v, (b,), generator=gen)
    for i in range(1, s):
        x[:, i] = (a[:, 0] * x[:, i - 1] + c[:, 0]) % v
    flip = torch.rand(b, s, generator=gen) < noise
    x = torch.where(flip, torch.randint(0, v, (b, s), generator=gen), x)
    pos = torch.arange(seq_length).unsqueeze(0).expand(b, -1)
    return MicroBatch(tokens=x[:, :-1].contiguous(), labels=x[:, 1:].contiguous(),
                      position_ids=pos)


def replica_microbatches(*, offset: int, count: int, **kwargs: int) -> list[MicroBatch]:
    """This replica's slice of the step's global batch."""
    return [synthetic_microbatch(index=offset + k, **kwargs) for k in range(count)]
