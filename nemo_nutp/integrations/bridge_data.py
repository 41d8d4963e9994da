"""Bridge's own data pipeline under NUTP: the recipe's dataset, each replica its share.

Contract (``train_iterator``):
- The dataset is the recipe's (``cfg.dataset``), built by Bridge's own code exactly as Bridge's
  ``setup()`` builds it: Bridge's tokenizer (``build_tokenizer``), its vocabulary check
  (``_validate_and_set_vocab_size``), its dataset provider (``get_dataset_provider``, e.g.
  megatron's ``MockGPTDataset`` for a recipe without data paths) and its sample targets
  (``build_train_valid_test_datasets``).
- The sampler is Bridge's (``build_pretraining_data_loader`` picks it by
  ``dataset.dataloader_type``), built as for ONE data-parallel rank: it walks the global batch,
  micro-batch by micro-batch, in the order a single process trains it. ``ReplicaShareSampler``
  keeps this replica's share of every global batch: micro-batches ``offset .. offset+count-1``
  of the ``num_microbatches`` the global batch has (the plan's shares, the same slicing as
  ``nutp-train``: ``nemo_nutp.data``). Every TP rank of a replica builds the same sampler, so
  they read the same samples; the union over replicas is the global batch.
- Resuming continues at ``train_state.consumed_train_samples``, the global sample count (Bridge
  keeps it global under NUTP: ``bridge_run.global_samples``).
- Validation (``valid_iterator``, evaluation during training): Bridge's validation loader as its
  ``build_train_valid_test_data_loaders`` builds it, for one data-parallel rank, cut the same
  way with the training shares (the evaluation batch is the training one: ``check_dataset``).
  A share keeps its position in the stream when a cyclic loader starts a new epoch.
Supported: ``dataloader_type`` ``single`` and ``cyclic`` (samplers of micro-batches); ``batch``
(one list per global batch, for padded fine-tuning) and ``external`` are rejected by name.

Per-rank cost: the stock sampler at one DP rank walks the global batch's sample indices
(O(global batch) integers per step, what a stock Bridge DP rank's sampler walks too); the
dataset is built on every rank, as Bridge does for TP-replicated loading.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

SAMPLER_TYPES = ("single", "cyclic")
"""``dataset.dataloader_type`` values whose sampler yields micro-batches (shareable)."""


def check_dataset(cfg: Any) -> None:
    """One-line ``ValueError`` (before any process group) for a data setting NUTP cannot
    honour: a sampler that is not per micro-batch, an evaluation batch other than the training
    one (each replica evaluates its training share of every validation global batch), a
    NullTokenizer vocabulary the model cannot embed."""
    kind = getattr(cfg.dataset, "dataloader_type", None)
    if kind is not None and kind not in SAMPLER_TYPES:
        raise ValueError(f"dataset.dataloader_type={kind}: not supported with NUTP "
                         f"(one of {', '.join(SAMPLER_TYPES)})")
    v, t = cfg.validation, cfg.train
    for name, train_name in (("eval_global_batch_size", "global_batch_size"),
                             ("eval_micro_batch_size", "micro_batch_size")):
        value, train_value = getattr(v, name), getattr(t, train_name)
        if evaluates(cfg) and value is not None and value != train_value:
            raise ValueError(f"validation.{name}={value}: NUTP evaluates with the training "
                             f"batch (leave it null or set train.{train_name}={train_value})")
    tok = cfg.tokenizer
    model_vocab = cfg.model.vocab_size
    if tok.tokenizer_type == "NullTokenizer" and model_vocab is not None \
            and tok.vocab_size is not None and tok.vocab_size > model_vocab:
        raise ValueError(f"tokenizer.vocab_size={tok.vocab_size}: larger than "
                         f"model.vocab_size={model_vocab}")


def evaluates(cfg: Any) -> bool:
    """Whether Bridge's ``train()`` evaluates during training (``validation.eval_iters`` and
    ``validation.eval_interval`` both set)."""
    return bool(cfg.validation.eval_iters) and bool(cfg.validation.eval_interval)


class ReplicaShareSampler:
    """A replica's share of every global batch of a micro-batch sampler built for one DP rank:
    of each ``num_microbatches`` consecutive micro-batches it yields, it keeps positions
    ``offset .. offset+count-1``."""

    def __init__(self, inner: Any, *, num_microbatches: int, offset: int, count: int) -> None:
        if not 0 <= offset < offset + count <= num_microbatches:
            raise ValueError(f"replica share [{offset}, {offset + count}) outside the "
                             f"{num_microbatches} micro-batches of the global batch")
        self.inner = inner
        self.num_microbatches, self.offset, self.count = num_microbatches, offset, count
        self.position = 0

    def __iter__(self) -> Iterator[list[int]]:
        # the position in the stream continues across iterations: a cyclic loader re-iterates
        # its sampler at every epoch, mid global batch for one process too
        lo, hi, m = self.offset, self.offset + self.count, self.num_microbatches
        for micro in self.inner:
            i, self.position = self.position, self.position + 1
            if lo <= i % m < hi:
                yield micro

    def __len__(self) -> int:
        return len(self.inner)


def dataset_provider(cfg: Any, pgs: Any) -> Any:
    """What Bridge's ``setup()`` does before it builds data: tokenizer, the model vocabulary
    check, ``cfg.dataset.tokenizer`` and ``token_dtype_code``; returns the bound dataset
    provider."""
    import numpy
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training.setup import (
        _bind_dataset_provider_context,
        _validate_and_set_vocab_size,
    )
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.tokenizer)
    _validate_and_set_vocab_size(
        model_vocab_size=cfg.model.vocab_size, tokenizer_vocab_size=tokenizer.vocab_size,
        use_tokenizer_vocab_size=getattr(cfg.tokenizer, "use_tokenizer_vocab_size", False))
    if hasattr(cfg.dataset, "tokenizer"):
        cfg.dataset.tokenizer = tokenizer
    if getattr(cfg.dataset, "token_dtype_code", 0) is None:
        big = tokenizer.vocab_size > numpy.iinfo(numpy.uint16).max + 1
        cfg.dataset.token_dtype_code = 4 if big else 8
    return _bind_dataset_provider_context(get_dataset_provider(cfg.dataset),
                                          tokenizer=tokenizer, pg_collection=pgs)


def stock_loader(cfg: Any, dataset: Any, consumed: int, *, dp_rank: int = 0,
                 dp_size: int = 1, kind: str | None = None, drop_last: bool | None = None) -> Any:
    """Bridge's own training ``DataLoader`` of ``dataset`` for one data-parallel rank (its
    ``build_pretraining_data_loader`` with the recipe's loader settings); ``kind`` and
    ``drop_last``: the validation loader's, where they differ."""
    from megatron.bridge.data.samplers import build_pretraining_data_loader

    d = cfg.dataset
    seed = getattr(d, "random_seed", None)
    return build_pretraining_data_loader(
        dataset, consumed, d.dataloader_type if kind is None else kind,
        cfg.train.micro_batch_size, d.num_workers,
        d.data_sharding, collate_fn=getattr(dataset, "collate_fn", None),
        pin_memory=d.pin_memory, persistent_workers=d.persistent_workers,
        data_parallel_rank=dp_rank, data_parallel_size=dp_size,
        global_batch_size=cfg.train.global_batch_size,
        drop_last=d.drop_last if drop_last is None else drop_last,
        seed=cfg.rng.seed if seed is None else seed)


def datasets(cfg: Any, pgs: Any) -> tuple[Any, Any, Any]:
    """The recipe's (train, validation, test) datasets, built by Bridge together (collective
    where megatron's dataset builder is: every rank of the world calls it)."""
    from megatron.bridge.data.loaders import build_train_valid_test_datasets

    return build_train_valid_test_datasets(cfg, dataset_provider(cfg, pgs))


def train_dataset(cfg: Any, pgs: Any) -> Any:
    """The recipe's training dataset, built by Bridge (``datasets``)."""
    return datasets(cfg, pgs)[0]


def _share_iterator(stock: Any, dataset: Any, kind: str, *, num_microbatches: int,
                    offset: int, count: int) -> Any:
    from megatron.bridge.data.loaders import cyclic_iter
    from megatron.core.rerun_state_machine import RerunDataIterator
    from torch.utils.data import DataLoader

    share = ReplicaShareSampler(stock.batch_sampler, num_microbatches=num_microbatches,
                                offset=offset, count=count)
    loader = DataLoader(dataset, batch_sampler=share, num_workers=stock.num_workers,
                        pin_memory=stock.pin_memory, collate_fn=stock.collate_fn,
                        persistent_workers=stock.persistent_workers,
                        worker_init_fn=stock.worker_init_fn)
    if kind == "cyclic":
        return RerunDataIterator(iter(cyclic_iter(loader)))
    return RerunDataIterator(iter(loader))


def train_iterator(cfg: Any, train_state: Any, pgs: Any, *, num_microbatches: int,
                   offset: int, count: int, dataset: Any = None) -> Any:
    """This replica's training iterator over Bridge's data pipeline (module docstring);
    ``dataset``: the training dataset when already built (``datasets``)."""
    check_dataset(cfg)
    if dataset is None:
        dataset = train_dataset(cfg, pgs)
    stock = stock_loader(cfg, dataset, train_state.consumed_train_samples)
    train_state.do_train = cfg.train.train_iters > 0
    return _share_iterator(stock, dataset, cfg.dataset.dataloader_type,
                           num_microbatches=num_microbatches, offset=offset, count=count)


def valid_iterator(cfg: Any, train_state: Any, dataset: Any, *, num_microbatches: int,
                   offset: int, count: int) -> Any:
    """This replica's validation iterator (None, and ``train_state.do_valid`` false, where
    Bridge's ``train()`` does not evaluate): Bridge's validation loader for one data-parallel
    rank as its ``build_train_valid_test_data_loaders`` builds it (``cyclic`` for a GPT
    dataset, else ``dataset.dataloader_type``; at ``consumed_valid_samples``; the evaluation
    batch, which ``check_dataset`` holds at the training one), this replica's share of every
    validation global batch (``ReplicaShareSampler``, the training shares)."""
    from megatron.bridge.training.config import GPTDatasetConfig

    check_dataset(cfg)
    train_state.do_valid = evaluates(cfg) and dataset is not None
    if not train_state.do_valid:
        return None
    kind = "cyclic" if isinstance(cfg.dataset, GPTDatasetConfig) else cfg.dataset.dataloader_type
    stock = stock_loader(cfg, dataset, train_state.consumed_valid_samples, kind=kind,
                         drop_last=True)
    return _share_iterator(stock, dataset, kind, num_microbatches=num_microbatches,
                           offset=offset, count=count)
