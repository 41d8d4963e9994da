"""Token windows from a megatron-core indexed dataset (``.bin``/``.idx``), addressed like the
synthetic stream: global sample ``g = (step * M + microbatch) * b + i`` reads the window of
``seq_length + 1`` tokens starting at ``g * seq_length`` (wrapping), so every layout reads the
same samples."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from .synthetic import MicroBatch


def _read_tokens(path_prefix: str, key: str = "train.data_path") -> np.ndarray:
    """All tokens of the dataset. A malformed or truncated file is a ``ValueError`` naming it.

    megatron's reader fails on bad files with messages that name no file (a truncated ``.bin``:
    "buffer is smaller than requested size"), and a half-built ``IndexedDataset`` then raises in
    its ``__del__`` ("Exception ignored in ..."): it is released here, with that report muted,
    before our error propagates (no reference to it survives the ``except`` block)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    problem = None
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        try:
            ds = IndexedDataset(path_prefix)
            tokens = np.concatenate([np.asarray(ds[i]) for i in range(len(ds))])
            del ds
        except Exception as e:  # megatron asserts on malformed index files
            problem = " ".join(str(e).split()) or type(e).__name__
    finally:
        sys.unraisablehook = hook
    if problem is not None:
        raise ValueError(f"{key}={path_prefix!r}: cannot read indexed dataset "
                         f"{path_prefix}.idx/.bin (malformed or truncated: {problem})")
    return tokens.astype(np.int64)


class IndexedTokenSource:
    def __init__(self, path_prefix: str, *, vocab_size: int, seq_length: int,
                 key: str = "train.data_path") -> None:
        """``key``: the config key errors name (``train.valid_data_path`` for validation)."""
        missing = [f"{path_prefix}{ext}" for ext in (".bin", ".idx")
                   if not os.path.isfile(f"{path_prefix}{ext}")]
        if missing:
            raise ValueError(f"{key}={path_prefix!r}: missing {', '.join(missing)}")
        self.tokens = _read_tokens(path_prefix, key)
        if self.tokens.size < seq_length + 2:
            raise ValueError(f"{key}={path_prefix!r}: only {self.tokens.size} tokens")
        if int(self.tokens.max()) >= vocab_size:
            raise ValueError(f"{key}={path_prefix!r}: token id {self.tokens.max()} >= "
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
