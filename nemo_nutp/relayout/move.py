"""Execute a ``MovePlan``: every new rank gets its model shards and optimizer state in memory.

``move_state(move, old=..., new=..., group=...)`` is collective over ``group`` (the new plan's
ranks, ``group.rank()`` == new rank; dead ranks take no part). It overwrites, in place, the
new session's parameters, fp32 master weights (mixed precision), every per-element optimizer
state (Adam ``exp_avg``/``exp_avg_sq``), the per-parameter ``step`` and the fp16 loss scaler so
that the new session holds exactly what ``checkpoint.load_checkpoint`` of the last committed
step would give it (bitwise; ``tests/relayout`` compares the two). It reads only the old
session's tensors, never its process groups. RNG states, data position, ledger and rebalancing
state are the caller's.

Wire protocol (NCCL-safe): one small ``all_reduce`` first (every rank's plan digest and round
count: a rank with another plan raises instead of deadlocking; it is also the group's first
collective, which NCCL wants before batched p2p). Then ``rounds`` rounds; in round ``k`` every
ordered pair (src, dst) with a ``k``-th chunk exchanges it, all of a rank's sends and receives of
the round posted as ONE ``dist.batch_isend_irecv`` and waited before the next round. Both ends
cut the pair's stream (pieces in plan order, parameters by global name, units, then fields)
into the same chunks (``plan.split_stream``), so matching is by construction, at most one
message per ordered pair per round: under in-order blocking p2p no two ranks wait on each other
in opposite orders. Buffers: one chunk (``bucket_bytes``, or one unit if larger) per peer per
round; bytes on the wire are raw tensor bytes (bf16 stays 2 bytes), so received bytes equal the
plan's lower bound exactly.

MoE: every expert tensor (``nutp_expert``: its global index; one tensor per expert and layer,
under its global name) moves whole with its optimizer state, as the units of the plan's
``expert`` space (``plan_move(experts=move_experts(...))``). The routers are replicated
(``rep``).

Not supported (``MoveImpossible``, the caller falls back to restart): a plan with
``possible=False``; a session with experts and a plan without them; a router's expert bias
(a buffer: not moved yet). NUTP's distributed optimizer moves by its slices instead
(``zero_move.py``, with ``recovery.live_redundancy``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..layout.units import PARAM_KINDS, unit_view_shape
from .plan import EXPERT, REP, MovePlan, Piece, split_stream

if TYPE_CHECKING:
    from ..train.session import RankSession


class MoveImpossible(RuntimeError):
    """The state cannot be moved in memory (reason in the message): restart instead."""


@dataclass
class MoveReport:
    received_bytes: int
    lower_bound_bytes: int
    sent_bytes: int
    local_bytes: int
    rounds: int
    peak_buffer_bytes: int
    seconds: float
    old_state_bytes: int
    new_state_bytes: int
    posted: list[tuple[int, int, str, int]]  # (round, peer new rank, send|recv, bytes)

    @property
    def peak_memory_ratio(self) -> float:
        """(old state + new state + peak buffers) / new state: resident model + optimizer
        state at the move's peak against the steady state of the new layout."""
        peak = self.old_state_bytes + self.new_state_bytes + self.peak_buffer_bytes
        return peak / max(1, self.new_state_bytes)

    def as_dict(self) -> dict[str, Any]:
        """The figures (without the posted-op log)."""
        out = {k: v for k, v in asdict(self).items() if k != "posted"}
        return {**out, "peak_memory_ratio": self.peak_memory_ratio}


@dataclass
class _Param:
    name: str
    kind: str | None
    lo: int
    fields: list[torch.Tensor]  # param, [fp32 master], optimizer states (sorted keys)
    expert: int | None = None  # a routed expert's tensor: its global expert index

    @property
    def space(self) -> str:
        if self.expert is not None:
            return EXPERT
        return REP if self.kind is None else PARAM_KINDS[self.kind].space

    def views(self, dims: Any, lo: int, hi: int) -> list[torch.Tensor]:
        """Units [lo, hi) (global unit indices) of every field, (n, H, W) in canonical
        order; REP: the whole tensor as (1, numel); an expert's tensor: whole, as (1, numel)
        (``[lo, hi)`` is its own expert)."""
        if self.expert is not None:
            assert (lo, hi) == (self.expert, self.expert + 1), (self.name, lo, hi)
            return [f.view(1, -1) for f in self.fields]
        if self.kind is None:
            return [f.view(1, -1) for f in self.fields]
        n = self.fields[0].numel() // self._unit_numel(dims)
        a, b = lo - self.lo, hi - self.lo
        assert 0 <= a <= b <= n, (self.name, lo, hi, self.lo, n)
        return [f.view(unit_view_shape(self.kind, dims, n)).transpose(0, 1)[a:b]
                for f in self.fields]

    def _unit_numel(self, dims: Any) -> int:
        h, _, w = unit_view_shape(self.kind or "", dims, 1)
        return h * w

    def unit_bytes(self, dims: Any) -> int:
        per = (self.fields[0].numel() if self.kind is None or self.expert is not None
               else self._unit_numel(dims))
        return sum(per * f.element_size() for f in self.fields)


def _inner(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _state_fields(optimizer: Any) -> dict[int, tuple[torch.Tensor | None, dict[str, Any]]]:
    """id(model param) -> (fp32 master or None, its optimizer state dict), states created
    (zeros) where the optimizer has not stepped yet, as megatron's loader does."""
    if getattr(optimizer, "nutp_zero", False):
        raise MoveImpossible("the distributed optimizer's state moves by its slices "
                             "(relayout/zero_move.py), not by units")
    out: dict[int, tuple[torch.Tensor | None, dict[str, Any]]] = {}
    for inner in _inner(optimizer):
        try:
            inner.init_state_fn(inner.optimizer, inner.config)
        except TypeError:
            inner.init_state_fn(inner.optimizer)
        state = inner.optimizer.state
        masters = getattr(inner, "fp32_from_float16_groups", None)
        if masters is not None:
            for g16, g32 in zip(inner.float16_groups, masters, strict=True):
                for p16, p32 in zip(g16, g32, strict=True):
                    out[id(p16)] = (p32, state[p32])
            for group in getattr(inner, "fp32_from_fp32_groups", []):
                for p in group:
                    out[id(p)] = (None, state[p])
        else:
            for group in inner.optimizer.param_groups:
                for p in group["params"]:
                    out[id(p)] = (None, state[p])
    return out


def _params(session: RankSession) -> tuple[dict[str, _Param], torch.Tensor | None]:
    """This session's movable tensors by global name, and one per-parameter ``step``."""
    states = _state_fields(session.optimizer)
    out: dict[str, _Param] = {}
    step = None
    for p in session.gpt.parameters():
        master, st = states[id(p)]
        keys = sorted(k for k, v in st.items()
                      if k != "step" and torch.is_tensor(v) and v.shape == p.shape)
        fields = [p.data] + ([master.data] if master is not None else []) + [st[k] for k in keys]
        units = getattr(p, "nutp_units", None)
        expert = getattr(p, "nutp_expert", None)
        out[p.nutp_name] = _Param(p.nutp_name, p.nutp_kind, units[0] if units else 0, fields,
                                  None if expert is None else int(expert))
        if "step" in st and step is None:
            step = st["step"]
    return out, step


def _stream(move: MovePlan, pieces: list[Piece], params: dict[str, _Param], dims: Any,
            bucket: int) -> tuple[list[list[tuple[Any, int, int]]], dict[Any, Piece]]:
    items: list[tuple[Any, int, int]] = []
    where: dict[Any, Piece] = {}
    for k, pc in enumerate(pieces):
        for name in _names(params, pc):
            key = (k, name)
            e = params[name].expert
            where[key] = pc if e is None else dataclasses.replace(pc, lo=e, hi=e + 1)
            items.append((key, where[key].hi - where[key].lo, params[name].unit_bytes(dims)))
    return split_stream(items, bucket), where


def _names(params: dict[str, _Param], pc: Piece) -> list[str]:
    """The parameters a piece moves, by global name: every one of its space (an expert
    piece: the tensors of its experts only)."""
    return sorted(n for n, p in params.items() if p.space == pc.space and (
        p.expert is None or pc.lo <= p.expert < pc.hi))


def _pair_pieces(move: MovePlan, me_old: int | None, me_new: int
                 ) -> tuple[dict[int, list[Piece]], dict[int, list[Piece]], list[Piece]]:
    sends: dict[int, list[Piece]] = {}
    recvs: dict[int, list[Piece]] = {}
    local: list[Piece] = []
    for p in move.pieces:
        if move.is_local(p):
            if p.dst == me_new:
                local.append(p)
        elif p.src == me_old:
            sends.setdefault(p.dst, []).append(p)
        elif p.dst == me_new:
            recvs.setdefault(move.rank_map[p.src], []).append(p)
    return sends, recvs, local


def _digest(move: MovePlan, fields: list[str]) -> int:
    h = hashlib.sha256(repr((move.pieces, sorted(move.rank_map.items()), fields)).encode())
    return int.from_bytes(h.digest()[:6], "little")


def _agree(move: MovePlan, group: Any, rounds: int, fields: list[str],
           device: torch.device) -> int:
    d = _digest(move, fields)
    t = torch.tensor([d, -d, rounds], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != -int(t[1]):
        raise RuntimeError("relayout: ranks hold different move plans or state fields "
                           "(same old/new plans and precision on every rank required)")
    return int(t[2])


def _pack(chunk: list[tuple[Any, int, int]], where: dict[Any, Piece], params: dict[str, _Param],
          dims: Any) -> torch.Tensor:
    parts = []
    for key, u0, u1 in chunk:
        pc = where[key]
        for v in params[key[1]].views(dims, pc.lo + u0, pc.lo + u1):
            flat = v.reshape(-1)
            if flat.stride(-1) != 1:  # a one-element view keeps its parent's stride
                flat = flat.clone(memory_format=torch.contiguous_format)
            parts.append(flat.view(torch.uint8))
    assert parts, "a chunk is never empty (split_stream)"
    return torch.cat(parts)


def _chunk_bytes(chunk: list[tuple[Any, int, int]], where: dict[Any, Piece],
                 params: dict[str, _Param], dims: Any) -> int:
    return sum((u1 - u0) * params[key[1]].unit_bytes(dims) for key, u0, u1 in chunk)


@torch.no_grad()
def _unpack(buf: torch.Tensor, chunk: list[tuple[Any, int, int]], where: dict[Any, Piece],
            params: dict[str, _Param], dims: Any) -> None:
    off = 0
    for key, u0, u1 in chunk:
        pc = where[key]
        for v in params[key[1]].views(dims, pc.lo + u0, pc.lo + u1):
            n = v.numel() * v.element_size()
            v.copy_(buf[off:off + n].clone().view(v.dtype).view(v.shape))
            off += n
    assert off == buf.numel(), (off, buf.numel())


@torch.no_grad()
def _local_copy(pieces: list[Piece], old: dict[str, _Param], new: dict[str, _Param],
                dims: Any) -> int:
    done = 0
    for pc in pieces:
        for name in _names(new, pc):
            p = new[name]
            lo, hi = (pc.lo, pc.hi) if p.expert is None else (p.expert, p.expert + 1)
            for dst, src in zip(p.views(dims, lo, hi), old[name].views(dims, lo, hi),
                                strict=True):
                dst.copy_(src)
                done += dst.numel() * dst.element_size()
    return done


def experts_of(session: Any) -> Any:
    """The ``plan.MoveExperts`` of a session's model (its megatron config's MoE fields), None
    without experts; ``MoveImpossible`` naming the setting the move does not plan yet."""
    from .plan import move_experts

    config = getattr(session.gpt, "config", None)
    if getattr(config, "num_moe_experts", None) is None:
        return None
    try:
        return move_experts(session.plan.request.model, config)
    except ValueError as e:
        raise MoveImpossible(str(e)) from e


def _check_experts(move: MovePlan, old: Any | None, new: Any, src: dict[str, _Param],
                   dst: dict[str, _Param]) -> None:
    """``MoveImpossible`` for MoE state this move would leave behind (before any collective:
    every rank of the group sees the same sessions' kind)."""
    if move.experts is None and any(p.expert is not None for p in (*src.values(),
                                                                    *dst.values())):
        raise MoveImpossible("model.num_moe_experts: a session with experts needs a move plan "
                             "with them (plan_move(experts=move_experts(...)))")
    for s in (old, new):
        if s is not None and any(getattr(m, "expert_bias", None) is not None
                                 for m in s.gpt.modules()):
            raise MoveImpossible("model.moe_router_enable_expert_bias=True: the expert bias "
                                 "(a buffer) is not moved yet")


def _state_bytes(params: dict[str, _Param]) -> int:
    return sum(f.numel() * f.element_size() for p in params.values() for f in p.fields)


def move_state(move: MovePlan, *, old: Any | None, new: Any, group: Any,
               bucket_bytes: int = 32 << 20) -> MoveReport:
    """Fill ``new`` (a session of the new plan) from the survivors' old sessions; collective
    over ``group``. See the module docstring for what is moved and how. ``old=None``: this
    rank is a joiner (a returning GPU's new process, ``plan_move(joiners=...)``): it sends
    nothing and receives everything it holds."""
    if not move.possible:
        raise MoveImpossible(move.reason)
    t0 = time.perf_counter()
    me_new = new.groups.ctx.rank
    me_old = None if old is None else old.groups.ctx.rank
    if group.rank() != me_new or (me_old is not None and move.rank_map.get(me_old) != me_new) \
            or (me_old is None and me_new in move.rank_map.values()):
        raise ValueError(f"relayout: group rank {group.rank()}, new rank {me_new}, old rank "
                         f"{me_old}: the group's rank must be the new rank of this survivor")
    dims = new.plan.request.model
    src, step_old = _params(old) if old is not None else ({}, None)
    dst, step_new = _params(new)
    _check_experts(move, old, new, src, dst)
    fields = sorted({(p.space, len(p.fields), str([f.dtype for f in p.fields]))
                     for p in (*src.values(), *dst.values())})
    sends, recvs, local = _pair_pieces(move, me_old, me_new)
    out_chunks = {d: _stream(move, ps, src, dims, bucket_bytes) for d, ps in sends.items()}
    in_chunks = {s: _stream(move, ps, dst, dims, bucket_bytes) for s, ps in recvs.items()}
    mine = max([len(c) for c, _ in (*out_chunks.values(), *in_chunks.values())], default=0)
    device = next(iter(dst.values())).fields[0].device  # NCCL: buffers on the GPU
    rounds = _agree(move, group, mine, [str(f) for f in fields], device)
    local_bytes = _local_copy(local, src, dst, dims)
    received = sent = peak = 0
    posted: list[tuple[int, int, str, int]] = []
    for r in range(rounds):
        ops, got, size = [], [], 0
        for d, (chunks, where) in sorted(out_chunks.items()):
            if r < len(chunks):
                buf = _pack(chunks[r], where, src, dims)
                ops.append(dist.P2POp(dist.isend, buf, group=group, group_peer=d))
                posted.append((r, d, "send", buf.numel()))
                sent += buf.numel()
                size += buf.numel()
        for s, (chunks, where) in sorted(in_chunks.items()):
            if r < len(chunks):
                buf = torch.empty(_chunk_bytes(chunks[r], where, dst, dims), dtype=torch.uint8,
                                  device=device)
                ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=s))
                posted.append((r, s, "recv", buf.numel()))
                got.append((buf, chunks[r], where))
                size += buf.numel()
        peak = max(peak, size)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for buf, chunk, where in got:
            _unpack(buf, chunk, where, dst, dims)
            received += buf.numel()
    _carry_scalars(old, new, step_old, step_new, group=group, device=device,
                   joining=len(move.rank_map) < len(move.lower_bound_bytes))
    return MoveReport(received_bytes=received, lower_bound_bytes=move.lower_bound_bytes[me_new],
                      sent_bytes=sent, local_bytes=local_bytes, rounds=rounds,
                      peak_buffer_bytes=peak, seconds=time.perf_counter() - t0,
                      old_state_bytes=_state_bytes(src), new_state_bytes=_state_bytes(dst),
                      posted=posted)


def _scalars(optimizer: Any, step: torch.Tensor | None) -> tuple[list[float], list[Any]]:
    """The per-parameter Adam ``step`` and every loss scaler's state as one float list (a
    fixed length for a given config), and the scalers' state dicts (their keys)."""
    vals = [float(step) if step is not None else -1.0]
    dicts = []
    for inner in _inner(optimizer):
        gs = getattr(inner, "grad_scaler", None)
        sd = gs.state_dict() if gs is not None else {}
        dicts.append(sd)
        vals += [float(sd[k]) for k in sorted(sd)]
    return vals, dicts


@torch.no_grad()
def _carry_scalars(old: Any | None, new: Any, step_old: torch.Tensor | None,
                   step_new: torch.Tensor | None, *, group: Any, device: torch.device,
                   joining: bool) -> None:
    """The per-parameter Adam ``step`` (equal for every parameter of every rank: megatron
    checkpoints keep one ``common_step``) and the fp16 loss scaler: this rank's own values; a
    joiner takes them from the survivors (one MAX all-reduce of a few numbers over the new
    world, posted only when the move has joiners: every rank knows that from the plan)."""
    if joining:
        vals, dicts = _scalars(new.optimizer if old is None else old.optimizer, step_old)
        if old is None:
            vals = [-1.0] * len(vals)
        t = torch.tensor(vals, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        got = [float(x) for x in t.tolist()]
        if old is None:
            if got[0] >= 0:
                step_old = torch.tensor(got[0], dtype=torch.float32)
            pos = 1
            for inner, sd in zip(_inner(new.optimizer), dicts, strict=True):
                gs = getattr(inner, "grad_scaler", None)
                if gs is None:
                    continue
                gs.load_state_dict({k: torch.tensor(got[pos + i], dtype=sd[k].dtype)
                                    if torch.is_tensor(sd[k]) else type(sd[k])(got[pos + i])
                                    for i, k in enumerate(sorted(sd))})
                pos += len(sd)
    if step_old is not None:
        for inner in _inner(new.optimizer):
            for st in inner.optimizer.state.values():
                st["step"] = step_old.clone()
    if old is not None:
        for a, b in zip(_inner(old.optimizer), _inner(new.optimizer), strict=True):
            ga, gb = getattr(a, "grad_scaler", None), getattr(b, "grad_scaler", None)
            if ga is not None and gb is not None:
                gb.load_state_dict(ga.state_dict())
    del step_new
