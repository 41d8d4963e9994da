"""megatron's ``P2PCommunicator`` for stages of different TP degree.

megatron's pipeline schedules (``get_forward_backward_func``: 1F1B, interleaved with virtual
stages) drive communication
through a ``P2PCommunicator``; every ``send_*``/``recv_*`` method ends in ``_communicate``.
``NUTPP2PCommunicator`` keeps megatron's schedule and methods and replaces only
``_communicate``: the activation and its gradient move between this rank and the ranks of the
neighbouring stages of its replica as ``pipeline.boundary`` maps them (rows of the sequence,
a piece per pair). ``pp_group`` is the rank's position among the stages (the schedule reads
its size and rank only). With virtual stages the stages form a ring: the last stage's next is
the first (``boundary.stage_links(ring=True)``).

Deadlock freedom: every TP rank of a stage runs the same schedule (same micro-batches, same
calls in the same order), so the stage-level protocol is megatron's; each call posts all of
its receives and sends before waiting on any, and two ranks exchange at most one message per
direction per call, in schedule order on both sides — except a ring of two stages, where an
activation and a gradient may go the same way in one call: receives are posted prev then next
and sends next then prev, so both sides order them alike (p2p matches per pair in order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from ..layout import Plan
from ..parallel.comm import Comm, ops_of
from .boundary import rows, stage_links

Slices = list[tuple[int, int, int]]  # (peer global rank, local row lo, local row hi)


class NUTPP2PCommunicator(P2PCommunicator):
    """Stage-boundary p2p of one rank, mapped from the plan."""

    def __init__(self, pp_group: dist.ProcessGroup, config: Any, *, plan: Plan,
                 rank: int, comm: Comm | None = None) -> None:
        super().__init__(pp_group, config)
        self.ops = ops_of(comm)  # timed per pair; delayed across domains (parallel/comm.py)
        i, s, j = plan.rank_index[rank]
        rep = plan.replicas[i]
        seq = plan.request.model.seq_length
        sp = plan.request.parallel.sequence_parallel
        lo0 = rows(rep.tp[s], j, seq, sp)[0]
        self.next_rank = self.prev_rank = None  # never used: peers come from the maps
        # with virtual stages the stages form a ring (stage pp-1 feeds stage 0's next chunk)
        links = stage_links(rep.tp, s, j, seq, sp, ring=plan.vp > 1)
        nxt, prv = rep.ranks[(s + 1) % plan.pp], rep.ranks[(s - 1) % plan.pp]

        def local(name: str, peers: tuple[int, ...]) -> Slices:
            return [(peers[k], lo - lo0, hi - lo0) for k, lo, hi in links[name]]

        self.send_next: Slices = local("send_next", nxt)  # activation rows to the next stage
        self.recv_next: Slices = local("recv_next", nxt)  # gradient rows from the next stage
        self.send_prev: Slices = local("send_prev", prv)  # gradient rows to the previous stage
        self.recv_prev: Slices = local("recv_prev", prv)  # activation rows from the previous
        self.nccl = dist.get_backend(pp_group) == "nccl"

    def _communicate(self, *, tensor_send_next: torch.Tensor | None,
                     tensor_send_prev: torch.Tensor | None, recv_prev: bool, recv_next: bool,
                     tensor_shape: Any, wait_on_reqs: bool = True
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        if self.config.variable_seq_lengths:
            raise ValueError("variable sequence lengths are not supported across NUTP stages")
        device = torch.cuda.current_device() if self.nccl else torch.device("cpu")
        ops: list[tuple[str, torch.Tensor, int]] = []

        def recv_buffer(slices: Slices) -> torch.Tensor:
            buf = torch.empty(tensor_shape, requires_grad=True, device=device,
                              dtype=self.config.pipeline_dtype)
            ops.extend(("recv", buf.data[lo:hi], peer) for peer, lo, hi in slices)
            return buf

        t_prev = recv_buffer(self.recv_prev) if recv_prev else None
        t_next = recv_buffer(self.recv_next) if recv_next else None
        for tensor, slices in ((tensor_send_next, self.send_next),
                               (tensor_send_prev, self.send_prev)):
            if tensor is not None:
                data = tensor.detach()
                ops.extend(("send", data[lo:hi].contiguous(), peer) for peer, lo, hi in slices)
        self.ops.exchange(ops, nccl=self.nccl)
        return t_prev, t_next, None

    def warm_up(self) -> None:
        """Every stage-boundary pair's communicator now, before the first step's heartbeat
        (NCCL creates a pair's at its first p2p; issue #22 finding 7): one element per slice
        of every direction, in one exchange (the schedule's own call; every rank of the
        replica calls it at session build)."""
        device = torch.cuda.current_device() if self.nccl else torch.device("cpu")
        dtype = self.config.pipeline_dtype or torch.float32
        ops = [("recv", torch.empty(1, device=device, dtype=dtype), peer)
               for peer, _, _ in self.recv_prev + self.recv_next]
        ops += [("send", torch.zeros(1, device=device, dtype=dtype), peer)
                for peer, _, _ in self.send_next + self.send_prev]
        self.ops.exchange(ops, nccl=self.nccl)
