"""Deterministic synthetic data, addressed by (seed, step, global micro-batch index).

The global batch of a step is micro-batches ``0..M-1``; replica ``r`` takes the contiguous slice
``[offset_r, offset_r + m_r)`` given by the plan, so the union over replicas is exactly the batch
a single-process run sees, whatever the layout. Sequences
follow a fixed random successor permutation with 10% noise tokens, so a model can learn them and
the loss falls (towards the noise entropy).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s]


def successor_table(seed: int, vocab_size: int) -> torch.Tensor:
    """The stream's fixed random successor permutation (depends on the seed only)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"succ:{seed}".encode()))
    return torch.randperm(vocab_size, generator=gen)


def synthetic_microbatch(*, seed: int, step: int, index: int, micro_batch_size: int,
                         seq_length: int, vocab_size: int, noise: float = 0.1,
                         split: str = "train") -> MicroBatch:
    """Micro-batch ``index`` of global batch ``step`` of the ``split`` ('train' or 'valid':
    the same successor table, i.e. the same language, drawn independently)."""
    key = f"{seed}:{step}:{index}" if split == "train" else f"{seed}:{split}:{step}:{index}"
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    succ = successor_table(seed, vocab_size)
    b, s, v = micro_batch_size, seq_length + 1, vocab_size
    x = torch.empty(b, s, dtype=torch.int64)
    x[:, 0] = torch.randint(0, v, (b,), generator=gen)
    flip = torch.rand(b, s, generator=gen) < noise
    rand = torch.randint(0, v, (b, s), generator=gen)
    for i in range(1, s):
        x[:, i] = torch.where(flip[:, i], rand[:, i], succ[x[:, i - 1]])
    pos = torch.arange(seq_length).unsqueeze(0).expand(b, -1)
    return MicroBatch(tokens=x[:, :-1].contiguous(), labels=x[:, 1:].contiguous(),
                      position_ids=pos)


def replica_microbatches(*, offset: int, count: int, **kwargs: Any) -> list[MicroBatch]:
    """This replica's slice of the step's global batch."""
    return [synthetic_microbatch(index=offset + k, **kwargs) for k in range(count)]
