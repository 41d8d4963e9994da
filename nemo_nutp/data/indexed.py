"""Token windows from a megatron-core indexed dataset (``.bin``/``.idx``), addressed like the
synthetic stream: global sample ``g = (step * M + microbatch) * b + i`` reads the window of
``seq_length + 1`` tokens starting at ``g * seq_length`` (wrapping), so every layout reads the
same samples."""

from __future__ import annotations

import os

import numpy as np
import torch

from .synthetic import MicroBatch


class IndexedTokenSource:
    def __init__(self, path_prefix: str, *, vocab_size: int, seq_length: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        missing = [f"{path_prefix}{ext}" for ext in (".bin", ".idx")
                   if not os.path.isfile(f"{path_prefix}{ext}")]
        if missing:
            raise ValueError(f"train.data_path={path_prefix!r}: missing {', '.join(missing)}")
        try:
            ds = IndexedDataset(path_prefix)
        except Exception as e:  # megatron asserts on malformed index files
            raise ValueError(f"train.data_path={path_prefix!r}: cannot open indexed dataset "
                             f"({e})") from None
        self.tokens = np.concatenate([np.asarray(ds[i]) for i in range(len(ds))]).astype(np.int64)
        if self.tokens.size < seq_length + 2:
            raise ValueError(f"train.data_path={path_prefix!r}: only {self.tokens.size} tokens")
        if int(self.tokens.max()) >= vocab_size:
            raise ValueError(f"train.data_path={path_prefix!r}: token id {self.tokens.max()} >= "
                             f"model.vocab_size={vocab_size}")
        self.seq = seq_length

    def microbatch(self, *, step: int, index: int, num_microbatches: int,
                   micro_batch_size: int) -> MicroBatch:
        b, s = micro_batch_size, self.seq
        span = self.tokens.size - s - 1
        g = (step * num_microbatches + index) * b + np.arange(b)
        starts = (g * s) % span
        win = np.stack([self.tokens[a:a + s + 1] for a in starts])
        x = torch.from_numpy(win)
        pos = torch.arange(s).unsqueeze(0).expand(b, -1)
        return MicroBatch(tokens=x[:, :-1].contiguous(), labels=x[:, 1:].contiguous(),
                          position_ids=pos)
