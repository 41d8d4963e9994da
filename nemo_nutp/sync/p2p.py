"""The one place the gradient sync posts point-to-point operations, and the per-pair order.

NCCL semantics (what this module guarantees, and ``tests/sync/test_pair_order.py`` replays):
un-batched p2p between two ranks runs in posting order on the pair's stream, each operation
blocking until the peer's matching one starts; gloo's unbounded async p2p hides any other order.
So for every pair of ranks both sides post their operations of one exchange in the *same*
sequence of messages, each side with the complementary operation (one's send is the other's
receive, same element count): ``pair_order`` gives that sequence from data both sides derive
alike (the coalesced messages of ``descriptors.plan_messages``), never from which side posts
first.

* ``exchange(ops)`` posts a whole exchange at once (the reshard-back path, the distributed
  optimizer's parameter and state moves): on NCCL one ``batch_isend_irecv`` (one NCCL group:
  the order inside it does not matter), elsewhere the operations one by one in ``ops``' order
  (callers sort them by ``pair_order``).
* ``isend`` / ``irecv`` post one operation (the forward reshard from the backward hooks, where
  operations become postable one after the other; ``engine`` posts each pair's operations in
  ``pair_order`` only).

``BACKEND`` is the adapter every caller goes through; a test replaces it with a recorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

Kind = Literal["send", "recv"]


@dataclass(frozen=True)
class Op:
    """One p2p operation: ``kind`` of ``tensor`` with global rank ``peer``."""

    kind: Kind
    tensor: torch.Tensor
    peer: int


class TorchP2P:
    """torch.distributed's p2p (the default backend)."""

    def isend(self, tensor: torch.Tensor, peer: int) -> Any:
        return dist.isend(tensor, peer)

    def irecv(self, tensor: torch.Tensor, peer: int) -> Any:
        return dist.irecv(tensor, peer)

    def exchange(self, ops: list[Op]) -> list[Any]:
        """Post ``ops`` as one exchange; one work per op (in order)."""
        if not ops:
            return []
        if dist.get_backend() == "nccl":
            p2p = [dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor,
                              op.peer) for op in ops]
            works = dist.batch_isend_irecv(p2p)
            return list(works) if len(works) == len(ops) else [_All(works)] * len(ops)
        return [self.isend(op.tensor, op.peer) if op.kind == "send"
                else self.irecv(op.tensor, op.peer) for op in ops]


class _All:
    """One handle over several works (a coalesced batch may return a single work)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


BACKEND: Any = TorchP2P()


def backend() -> Any:
    """The adapter in use (looked up at call time, so tests can replace ``BACKEND``)."""
    return BACKEND


def pair_order(last_param: int, sender: int, index: int) -> tuple[int, int, int]:
    """Sort key of a message between two ranks, the same on both sides: the canonical position
    of the parameter its sender completes it with (its last piece), then its sender, then its
    index among that sender's messages to that peer."""
    return (last_param, sender, index)
