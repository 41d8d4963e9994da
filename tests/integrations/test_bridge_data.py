"""``bridge_data``: each replica's share of Bridge's own samplers, and the data settings NUTP
rejects by name (single process, no process group)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

from nemo_nutp.compat.bridge_cpu import install_import_shim
from nemo_nutp.integrations.bridge_config import load_bridge_job
from tests.helpers.bridge_jobs import RECIPE, TINY


def _stock(kind: str, *, consumed: int, mbs: int) -> Any:
    install_import_shim()
    from megatron.bridge.data.samplers import (
        MegatronPretrainingRandomSampler,
        MegatronPretrainingSampler,
    )

    if kind == "single":
        return MegatronPretrainingSampler(total_samples=1000, consumed_samples=consumed,
                                          micro_batch_size=mbs, data_parallel_rank=0,
                                          data_parallel_size=1)
    return MegatronPretrainingRandomSampler(None, total_samples=1000, consumed_samples=consumed,
                                            micro_batch_size=mbs, data_parallel_rank=0,
                                            data_parallel_size=1, data_sharding=False)


@pytest.mark.parametrize("kind", ["single", "cyclic"])
@pytest.mark.parametrize("shares, mbs, consumed", [((4, 2), 1, 0), ((3, 2, 2), 2, 28),
                                                   ((1, 5), 3, 36)])
def test_replica_shares_partition_every_global_batch(kind: str, shares: tuple[int, ...],
                                                     mbs: int, consumed: int) -> None:
    """The replicas' shares of Bridge's sampler (built for one DP rank) are disjoint, in order,
    and together are exactly the global batches one process trains (resumed mid-run too)."""
    from itertools import islice

    from nemo_nutp.integrations.bridge_data import ReplicaShareSampler

    m, steps = sum(shares), 4
    one = list(islice(iter(_stock(kind, consumed=consumed, mbs=mbs)), m * steps))
    offsets = [sum(shares[:i]) for i in range(len(shares))]
    got = [list(islice(iter(ReplicaShareSampler(_stock(kind, consumed=consumed, mbs=mbs),
                                                num_microbatches=m, offset=o, count=c)),
                       c * steps))
           for o, c in zip(offsets, shares, strict=True)]
    for step in range(steps):
        merged = [mb for o, c, g in zip(offsets, shares, got, strict=True)
                  for mb in g[step * c:(step + 1) * c]]
        assert merged == one[step * m:(step + 1) * m], step


def test_shares_stay_aligned_across_a_cyclic_epoch_boundary() -> None:
    """A cyclic loader re-iterates its sampler at each epoch (``cyclic_iter``), here mid global
    batch (10 micro-batches an epoch, 4 a global batch): the shares keep their position in the
    stream, so they still partition the global batches one process reads."""
    install_import_shim()
    from megatron.bridge.data.samplers import MegatronPretrainingRandomSampler

    from nemo_nutp.integrations.bridge_data import ReplicaShareSampler

    def stock() -> Any:
        return MegatronPretrainingRandomSampler(None, total_samples=10, consumed_samples=0,
                                                micro_batch_size=1, data_parallel_rank=0,
                                                data_parallel_size=1, data_sharding=True)

    one_sampler = stock()
    one = list(one_sampler) + list(one_sampler)  # two epochs, 5 global batches
    shares = [ReplicaShareSampler(stock(), num_microbatches=4, offset=o, count=c)
              for o, c in ((0, 3), (3, 1))]
    got = [list(s) + list(s) for s in shares]
    assert [len(g) for g in got] == [15, 5]
    for step in range(5):
        assert got[0][step * 3:(step + 1) * 3] + got[1][step:step + 1] == \
            one[step * 4:(step + 1) * 4], step


def test_share_outside_the_global_batch_is_an_error() -> None:
    from nemo_nutp.integrations.bridge_data import ReplicaShareSampler

    with pytest.raises(ValueError, match=r"replica share \[4, 7\) outside the 6 micro-batches"):
        ReplicaShareSampler([], num_microbatches=6, offset=4, count=3)


@pytest.mark.parametrize("overrides, message", [
    (["dataset.dataloader_type=batch"], "dataset.dataloader_type=batch: not supported with NUTP"),
    (["validation.eval_iters=4", "validation.eval_interval=2",
      "validation.eval_global_batch_size=12"],
     "validation.eval_global_batch_size=12: NUTP evaluates with the training batch"),
    (["validation.eval_iters=4", "validation.eval_interval=2",
      "validation.eval_micro_batch_size=2"],
     "validation.eval_micro_batch_size=2: NUTP evaluates with the training batch"),
    (["tokenizer.vocab_size=300"], "tokenizer.vocab_size=300: larger than model.vocab_size=256"),
])
def test_data_settings_nutp_cannot_honour_are_rejected_by_name(overrides: list[str],
                                                               message: str) -> None:
    import torch.distributed as dist

    with pytest.raises(ValueError) as e:
        load_bridge_job(RECIPE, str(TINY), overrides)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not dist.is_initialized()
