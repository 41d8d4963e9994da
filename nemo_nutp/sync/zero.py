"""Distributed optimizer (ZeRO-1) over the NUTP sync owner groups.

Where the state lives: every bucket of the gradient sync (``engine.py``) is reduced by one
group — the owners of its sync shards (one rank per replica), the TP-rank-0 leaders (replicated
parameters) or, with sequence parallelism, the stage. Here each bucket is cut into ``G`` equal
slices (``G`` = its group's size, the last one shorter) and member ``j`` of the group keeps the
fp32 master weights and the optimizer state (Adam moments / SGD momentum) of slice ``j`` only.
A rank thus keeps state for ~1/R of the elements it owns in the sync layout (R = replicas), which
is ~1/R of what the non-distributed optimizer keeps for its local shard.

One step (``prepare_grads`` -> clipping in ``train/step.py`` -> ``step_with_ready_grads``):

1. the engine reduces each bucket with a reduce-scatter among its group (instead of the
   all-reduce), so each member receives only its slice, the fp32 gradient of its flat masters;
   no reduced gradient goes back to the holders (``main_grad`` stays local). The grad norm is
   still the single-process value, the same bits everywhere: per group one small all-reduce of
   the members' per-piece sums of squares (``engine._finish_scattered``);
2. megatron's inner optimizer class (torch ``AdamW``/``Adam``/``SGD`` with megatron's param
   groups and hyper-parameters, as ``get_megatron_optimizer`` builds it without TE/apex) updates
   the flat masters; clipping scales their gradients with megatron's
   ``clip_grad_by_total_norm_fp32`` and the NUTP norm, like the non-distributed path;
3. every bucket's updated slices are all-gathered in the parameter dtype (canonical bucket order,
   async); the owners write the units they hold and return the others to their holders over the
   engine's reshard messages (the return path, carrying parameters); without sequence
   parallelism the leader broadcasts the replicated parameters in its TP group.

MoE experts (``sync/experts.py``, ``model.nutp_experts``): one more space sliced the same way.
Each expert shard's holders (one rank per replica) are its group: the weighted expert gradients
are reduce-scattered among them (``ExpertSync.use_reduce_scatter``), member ``j`` keeps the
masters and state of slice ``j`` of the shard's packed buffer (its segments follow the dense
ones in each param group's flat master, ``_ExpertSegment``), and after the update the slices are
all-gathered straight into the holders' expert parameters (in the step, before the dense
gather; ``overlap_param_gather`` defers the dense gather only). The grad norm counts every
expert element once (``ExpertSync``'s per-member slots). Not with experts yet: checkpoints of
this optimizer (refused by name), ``recovery.live_redundancy`` (refused).

Pipeline stages with tied embeddings are the exception: the pipeline finalizer adds the other
stage's embedding gradient into ``main_grad`` after the sync, so there the buckets are
all-reduced as without this optimizer and the slices are taken from ``main_grad``.

fp32 models keep no masters between steps: they equal the parameters bit for bit and are taken
from them (holders -> owners) at each step, as megatron's optimizers view fp32 params.

Redundancy (``recovery.live_redundancy``, for live re-layouts): member ``j`` of every bucket's
group also keeps a copy of member ``j - 1``'s slice (ring order), masters and optimizer state,
so one rank's loss loses no state. The copy is updated *redundantly*, in the same inner
optimizer step and param group as the primary: before the live vote (``before_vote``) each
member sends its reduced gradient chunk to the next one (one ring exchange per step, 4 bytes
per slice element, a third of what sending the updated master and both Adam moments would
cost), and after the vote both the slice and the copy are updated from data the rank holds,
element-wise on the same inputs, so the copy equals the primary bit for bit
(``check_backups``). Sending the updated state instead would leave a dead rank's update of a
committed step nowhere if it died after the vote. Cost: the state per rank doubles (fp32
models also keep their masters). ``relayout/zero_move.py`` rebuilds a new layout's slices
from the survivors' primaries and the dead rank's copies.

Checkpoints: ``sharded_state_dict`` gathers the state back to the shape of the local parameters
and emits exactly what megatron's non-distributed ``FP32Optimizer`` (fp32) or
``Float16OptimizerWithFloat16Params`` (bf16) emits (same keys, param-group order and common
step), so checkpoints are interchangeable with the non-distributed optimizer and any layout;
``load_state_dict`` takes the local tensors and keeps its slices. Saving holds one full-size
state tensor per parameter at a time on each rank (transiently).

Collective (over the stage's sync groups): construction, ``step_with_ready_grads``,
``sharded_state_dict``, ``load_state_dict``, ``reload_model_params``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
from megatron.core.optimizer import _get_param_groups as megatron_param_groups

from . import p2p
from .engine import GradSyncEngine, _Bucket
from .mover import BucketMover


@dataclass(frozen=True)
class _Slice:
    """This rank's slice ``[start, stop)`` of a bucket; ``chunk`` = padded slice length;
    ``members``: the group's global ranks in group-rank order (member ``j`` keeps slice ``j``;
    with redundancy member ``j + 1`` keeps the copy of it, ring order)."""

    group: dist.ProcessGroup
    size: int
    index: int
    start: int
    stop: int
    chunk: int
    members: tuple[int, ...] = ()

    @property
    def succ(self) -> int:
        """The member keeping the copy of this rank's slice."""
        return self.members[(self.index + 1) % self.size]

    @property
    def pred(self) -> int:
        """The member whose slice this rank keeps a copy of."""
        return self.members[(self.index - 1) % self.size]


@dataclass(frozen=True)
class _Segment:
    """Elements ``[a, z)`` of a bucket (inside one piece of parameter ``param``) that sit at
    ``offset`` of the flat master of param group ``group``."""

    bucket: int
    a: int
    z: int
    group: int
    offset: int
    piece: int = 0  # index of the piece in the bucket's ``spec.pieces``


@dataclass(frozen=True)
class _ExpertSegment:
    """Elements ``[a, z)`` of expert slice ``slice``'s packed shard buffer (the slice starts
    at ``lo``), inside item ``item`` of the shard (which starts at ``at``), at ``offset`` of the
    flat master of param group ``group``."""

    slice: int
    a: int
    z: int
    lo: int
    item: int
    at: int
    group: int
    offset: int


def _expert_segments(experts: Any, group_of: dict[int, int], sizes: list[int]
                     ) -> list[_ExpertSegment]:
    """This rank's expert slices (``ExpertSync.use_reduce_scatter``) per item, placed after
    the dense segments in the flat tensor of their param group (``sizes`` grows)."""
    out = []
    for i, sl in enumerate(experts.use_reduce_scatter()):
        at = 0
        for j, (_, p) in enumerate(experts.items(sl.shard)):
            a, z = max(at, sl.start), min(at + p.numel(), sl.stop)
            if z > a:
                g = group_of[id(p)]
                out.append(_ExpertSegment(i, a, z, sl.start, j, at, g, sizes[g]))
                sizes[g] += z - a
            at += p.numel()
    return out


def bucket_slice(numel: int, size: int, index: int) -> tuple[int, int, int]:
    """(start, stop, chunk): member ``index`` of ``size`` keeps ``[start, stop)``; every slice
    is padded to ``chunk`` elements for the all-gather."""
    chunk = max(1, math.ceil(numel / size))
    return min(numel, index * chunk), min(numel, (index + 1) * chunk), chunk


STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class ZeroOptimizer:
    """ZeRO-1 over the sync owner groups (module docstring); the interface ``train/step.py``,
    ``train/loop.py`` and ``checkpoint/store.py`` use of megatron's optimizers."""

    nutp_zero = True

    def __init__(self, model: Any, config: OptimizerConfig, *, redundancy: bool = False,
                 overlap_param_gather: bool = False) -> None:
        engine: GradSyncEngine | None = getattr(model, "nutp_engine", None)
        if engine is None:
            raise ValueError("train.distributed_optimizer=true needs the NUTP DDP "
                             "(model.nutp_engine)")
        if config.fp16:
            raise ValueError("train.distributed_optimizer=true with train.precision=fp16 is "
                             "not supported (use bf16 or fp32)")
        self.config, self.engine = config, engine
        engine.keep_buckets = True
        self.mover = BucketMover(engine)
        self.params = [e.param for e in engine.order]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"train.distributed_optimizer=true: parameters of several dtypes "
                             f"{sorted(map(str, dtypes))}")
        self.param_dtype = self.params[0].dtype if self.params else torch.float32
        # megatron's groups, order and keys (get_megatron_optimizer's default overrides: no
        # weight decay multiplier on biases and 1-D params; 0.19 no longer applies them for None)
        groups = megatron_param_groups([model], config, get_standard_config_overrides(config))
        self.in_order = [p for g in groups for p in g["params"]]
        self.group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        self.slices = [self._slice(b) for b in engine.buckets]
        self.segments, sizes = self._segments(self.group_of, len(groups),
                                              [(sl.start, sl.stop) for sl in self.slices])
        # MoE experts (sync/experts.py): one more space, sliced among each shard's holders;
        # their segments follow the dense ones in every param group's flat master
        self.experts: Any = getattr(model, "nutp_experts", None)
        self.expert_segments: list[_ExpertSegment] = []
        if self.experts is not None:
            if redundancy:
                raise ValueError("recovery.live_redundancy=true: not with MoE experts under "
                                 "train.distributed_optimizer yet (no copies of expert slices)")
            self.expert_segments = _expert_segments(self.experts, self.group_of, sizes)
        self.sizes = sizes
        # recovery.live_redundancy: a copy of the predecessor's slice of every bucket (ring
        # order in the bucket's group), updated redundantly from its reduced gradient chunk
        if redundancy and any(sl.size < 2 for sl in self.slices):
            redundancy = False  # one replica left (after live re-layouts): nowhere to copy;
            if dist.get_rank() == 0:  # a failure then restarts (commit.live_blocker)
                print("nutp: recovery.live_redundancy: one replica, no copies of the "
                      "optimizer slices kept (a failure now restarts)", flush=True)
        self.redundancy = redundancy
        self.backup_bounds = [bucket_slice(b.spec.numel, sl.size, (sl.index - 1) % sl.size)[:2]
                              for b, sl in zip(engine.buckets, self.slices, strict=True)
                              ] if redundancy else []
        self.backup_segments, self.backup_sizes = (
            self._segments(self.group_of, len(groups), self.backup_bounds) if redundancy
            else ([], []))
        self.local_only = False  # live re-layout: update the slices, gather nothing
        self.before_publish: Callable[[], None] | None = None  # after the update, before the
        # parameters are gathered (live fault injection's ``gather`` phase)
        self._ready: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # overlap_param_gather: the step launches its parameter all-gathers and returns; they
        # complete (``settle``) at the first forward pre-hook of any module with parameters,
        # or before anything else reads the parameters. ``settled``: where they completed.
        self.overlap_param_gather = overlap_param_gather
        self._inflight: Iterator[tuple[int, torch.Tensor]] | None = None
        self.settled: dict[str, int] = {}
        self._hooks = [m.register_forward_pre_hook(self._pre_forward)
                       for m in model.module.modules()
                       if next(m.parameters(recurse=False), None) is not None
                       ] if overlap_param_gather else []
        # Pipeline stages with tied embeddings: the finalizer (pipeline/finalize.py) adds the
        # other stage's embedding gradient into main_grad after the sync, so the gradients are
        # taken from main_grad (holders -> owners, as the parameters) instead of the buckets.
        plan = engine.plan
        self.reread = plan.pp > 1 and bool(plan.request.model.tie_embeddings)
        # Otherwise the buckets are reduce-scattered: each member receives only its slice.
        self.scatter = not self.reread
        if self.scatter:
            engine.use_reduce_scatter([(sl.size, sl.index, sl.chunk) for sl in self.slices])
        # fp32 models: the masters equal the parameters bit for bit, so they are taken from
        # them at each step and freed after it (what megatron's optimizers get by viewing fp32
        # params); half-precision models keep them (their params are rounded).
        # With redundancy fp32 models keep them too: after the live vote the update must
        # need no collective (the parameters are taken to the owners before it).
        self.keep_masters = self.param_dtype != torch.float32 or redundancy
        self.masters = [torch.nn.Parameter(torch.empty(n, dtype=torch.float32,
                                                       device=self._dev()))
                        for n in sizes]
        self.backups = [torch.nn.Parameter(torch.empty(n, dtype=torch.float32,
                                                       device=self._dev()))
                        for n in self.backup_sizes]
        self._load_masters()
        if not self.keep_masters:
            self._free_masters()
        # The copies sit in their primary's param group: the same hyper-parameters (and
        # scheduler lr) and the same element-wise update, bit for bit.
        torch_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [m, *self.backups[gi:gi + 1]]}
                        for gi, (g, m) in enumerate(zip(groups, self.masters, strict=True))]
        dev = self._dev()
        self.optimizer = _inner_optimizer(config, torch_groups,
                                          cuda=dev is not None and dev.type == "cuda")

    # ---------------------------------------------------------------- layout
    def _dev(self) -> torch.device | None:
        return self.params[0].device if self.params else None

    @staticmethod
    def _slice(b: _Bucket) -> _Slice:
        size = dist.get_world_size(b.group)
        index = dist.get_group_rank(b.group, dist.get_rank())
        start, stop, chunk = bucket_slice(b.spec.numel, size, index)
        members = tuple(dist.get_global_rank(b.group, j) for j in range(size))
        return _Slice(b.group, size, index, start, stop, chunk, members)

    def _segments(self, group_of: dict[int, int], n_groups: int,
                  bounds: Sequence[tuple[int, int]]) -> tuple[list[_Segment], list[int]]:
        """The elements ``bounds[i]`` of every bucket ``i`` (this rank's slice, or the one it
        keeps a copy of), per piece, placed in a flat tensor per param group (bucket order)."""
        sizes = [0] * n_groups
        out = []
        for i, (b, (start, stop)) in enumerate(zip(self.engine.buckets, bounds, strict=True)):
            for k, pc in enumerate(b.spec.pieces):
                a, z = max(start, pc.offset), min(stop, pc.offset + pc.numel)
                if z <= a:
                    continue
                g = group_of[id(self.engine.order[pc.param].param)]
                out.append(_Segment(i, a, z, g, sizes[g], k))
                sizes[g] += z - a
        return out, sizes

    # ---------------------------------------------------------------- megatron interface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (megatron's keys: ``lr``, ``wd_mult``, ...), as megatron
        optimizers expose them to ``OptimizerParamScheduler``."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor([1.0])

    def get_parameters(self) -> list[torch.nn.Parameter]:
        return [*self.masters, *self.backups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in (*self.masters, *self.backups):
            m.grad = None

    @torch.no_grad()
    def _pre_forward(self, module: Any, args: Any) -> None:
        del module, args
        if self._inflight is not None:
            self.settle("forward")

    @torch.no_grad()
    def settle(self, where: str = "read", *, publish: bool = True) -> None:
        """Complete the parameter all-gathers a step launched (``overlap_param_gather``): wait
        for them bucket by bucket and reshard the parameters to their holders (``publish=False``:
        wait only, the parameters were just loaded from elsewhere). Collective over the stage's
        sync groups; a no-op when none is in flight."""
        if self._inflight is None:
            return
        gathered, self._inflight = self._inflight, None
        if publish:
            self._publish(gathered)
        else:
            for _ in gathered:
                pass
            if not self.keep_masters:
                self._free_masters()
        self.settled[where] = self.settled.get(where, 0) + 1

    def before_vote(self) -> None:
        """Every collective the update needs, done before the live vote (``session.step``),
        so that after it a rank completes the step from data it holds (``health/commit.py``):
        this rank's slices of the reduced buckets as the masters' fp32 gradients (fp32 models
        without redundancy: and the masters from the parameters) and, with redundancy, the
        predecessor's reduced chunk of every bucket (one ring exchange). Idempotent per step."""
        if self._ready is not None:
            return
        self.settle()  # (a step with no forward since the last one)
        if not self.keep_masters:
            self._load_masters()
        eng = self.engine
        # (buffer, offset of its first element in the bucket) per bucket
        bufs: list[tuple[torch.Tensor | None, int]] = [(b.buf, 0) for b in eng.buckets]
        if self.scatter:
            bufs = [(b.out, sl.start) for b, sl in zip(eng.buckets, self.slices, strict=True)]
        elif self.reread:
            full = self.mover.to_buckets([p.main_grad for p in self.params],  # type: ignore
                                         self.params[0].main_grad.dtype)  # type: ignore
            bufs = [(t, 0) for t in full]
        if any(buf is None for buf, _ in bufs):
            raise RuntimeError("distributed optimizer: the gradient sync kept no reduced "
                               "buckets (finish_grad_sync must run before the step)")
        grads = _flats_of(bufs, self.segments, self.sizes, self._dev())
        if self.experts is not None:  # this rank's reduce-scattered expert slices
            for s in self.expert_segments:
                grads[s.group][s.offset:s.offset + s.z - s.a].copy_(
                    self.experts.out[s.slice][s.a - s.lo:s.z - s.lo])
        backs: list[torch.Tensor] = []
        if self.redundancy:
            copies = bufs
            if self.scatter:  # the full buckets exist nowhere: the predecessor's chunk
                got = self._ring([b.out for b in eng.buckets])  # type: ignore[misc]
                copies = [(t, lo) for t, (lo, _) in zip(got, self.backup_bounds, strict=True)]
            backs = _flats_of(copies, self.backup_segments, self.backup_sizes, self._dev())
        self.engine.release_buckets()
        self._ready = (grads, backs)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """The masters' (and copies') fp32 gradients (``before_vote``, collective, unless it
        ran already this step)."""
        self.before_vote()
        assert self._ready is not None
        grads, backs = self._ready
        self._ready = None
        for m, g in zip((*self.masters, *self.backups), (*grads, *backs), strict=True):
            m.grad = g
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Update the slices (and copies), all-gather them per bucket, reshard parameters to
        holders (``local_only``: the update only, a live re-layout completing its step)."""
        self.optimizer.step()
        if self.local_only:
            return True
        if self.before_publish is not None:
            self.before_publish()  # slices updated, parameters not yet gathered
        if self.experts is not None:  # the expert slices now (before the masters are freed)
            self.experts.gather(self._expert_pieces(self.masters, self.param_dtype),
                                {id(p): p.data for p in self.expert_params()})
        if self.overlap_param_gather:  # launched now, completed by ``settle``
            self._inflight = self._gathered(self.masters, self.param_dtype)
            return True
        self.publish_params()
        return True

    @torch.no_grad()
    def publish_params(self) -> None:
        """The parameters from the masters: all-gather per bucket (in the parameter dtype),
        reshard to holders; collective. Bucket by bucket within the engine's staging window:
        never a full param-dtype copy of all buckets at once."""
        self.settle()
        self._publish(self._gathered(self.masters, self.param_dtype))

    def _publish(self, gathered: Iterator[tuple[int, torch.Tensor]]) -> None:
        self.mover.from_gathered(gathered, [p.data for p in self.params])
        if not self.keep_masters:
            self._free_masters()

    # ---------------------------------------------------------------- redundancy
    def _ring(self, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per bucket, send ``outs[i]`` (this rank's chunk) to the group's next member and
        receive the previous member's: one exchange over the world (``p2p``). Each pair's
        messages in one order both sides derive: by bucket (canonical order, shared by all
        members), then sender; a two-member group sends both ways in one bucket."""
        got = [torch.empty_like(t) for t in outs]
        for work in p2p.backend().exchange(ring_ops(self.slices, outs, got, dist.get_rank())):
            work.wait()
        return got

    def _fields(self, flats: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per param group, the state fields of ``flats`` (masters or copies): the master,
        then the inner optimizer's per-element state (created as zeros if missing)."""
        keys = self._state_keys()
        if keys and not self._has_state(keys[0]):
            keys = ()  # not stepped yet: the master only
        out = []
        for m in flats:
            st = self.optimizer.state[m]
            for k in keys:
                if k not in st:
                    st[k] = torch.zeros_like(m.data)
            out.append([m.data, *(st[k] for k in keys)])
        return out

    def _pack(self, fields: list[list[torch.Tensor]], segments: list[_Segment],
              bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Per bucket, the values of ``segments`` (of every field) as one (F x chunk) tensor."""
        n_f = len(fields[0]) if fields else 0
        chunks = [torch.zeros(n_f, sl.chunk, dtype=torch.float32, device=self._dev())
                  for sl in self.slices]
        for s in segments:
            lo = bounds[s.bucket][0]
            for f in range(n_f):
                chunks[s.bucket][f, s.a - lo:s.z - lo].copy_(
                    fields[s.group][f][s.offset:s.offset + s.z - s.a])
        return chunks

    @torch.no_grad()
    def check_backups(self) -> float:
        """Largest difference between a copy and its primary (0.0: bit for bit, as
        redundant updates from the same reduced gradient give); collective (tests)."""
        if not self.redundancy:
            return 0.0
        got = self._ring(self._pack(self._fields(self.masters), self.segments,
                                    [(sl.start, sl.stop) for sl in self.slices]))
        mine = self._pack(self._fields(self.backups), self.backup_segments, self.backup_bounds)
        worst = 0.0
        for a, b in zip(got, mine, strict=True):
            if a.numel():
                worst = max(worst, float((a - b).abs().max()))
        return worst

    def _free_masters(self) -> None:
        for m in self.masters:
            m.grad = None
            m.data = torch.empty(0, dtype=torch.float32, device=m.device)

    def _gather(self, flats: Sequence[torch.Tensor], dtype: torch.dtype
                ) -> list[torch.Tensor | None]:
        """Every bucket assembled from its members' slices (``flats``: per param group, this
        rank's flat slice values), all kept (checkpoints: ``mover.from_buckets``)."""
        return [buf for _, buf in self._gathered(flats, dtype)]

    def _gathered(self, flats: Sequence[torch.Tensor], dtype: torch.dtype
                  ) -> Iterator[tuple[int, torch.Tensor]]:
        """Every bucket assembled from its members' slices, within the engine's staging window
        (``_Gather``): the first window's all-gathers are launched now; iterating yields
        (bucket index, buffer) in bucket order."""
        return iter(_Gather(self, flats, dtype))

    def _take(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                          list[torch.Tensor]]:
        """This rank's flat slices (per param group) of per-parameter tensors (engine order),
        and those of the copies it keeps (redundancy; the full buckets hold them too)."""
        bufs: list[tuple[torch.Tensor | None, int]] = [
            (t, 0) for t in self.mover.to_buckets(tensors, torch.float32)]
        return (_flats_of(bufs, self.segments, self.sizes, self._dev()),
                _flats_of(bufs, self.backup_segments, self.backup_sizes, self._dev()))

    @torch.no_grad()
    def reload_model_params(self, state_dict: Any = None) -> None:
        """Masters from the model's current parameters (after a weights-only load; fp32 models
        take them at every step anyway); collective."""
        del state_dict
        self.settle("load", publish=False)
        if self.keep_masters:
            self._load_masters()

    def _load_masters(self) -> None:
        flats, backs = self._take([p.data for p in self.params])
        self._take_experts(flats, lambda p: p.data)
        for m, flat in zip((*self.masters, *self.backups), (*flats, *backs), strict=True):
            m.data = flat

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps between steps: fp32 masters (bf16, or
        with redundancy), the inner optimizer's state, and the copies (redundancy)."""
        n = sum(m.numel() * m.element_size() for m in (*self.masters, *self.backups))
        for st in self.optimizer.state.values():
            n += sum(t.numel() * t.element_size() for k, t in st.items()
                     if torch.is_tensor(t) and k != "step")
        return n

    # ---------------------------------------------------------------- checkpoints
    def _full(self, flats: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Per-parameter fp32 tensors (shaped like the local parameters, keyed by ``id``) of
        flat per-group slices: all-gather per bucket, then the parameter return path."""
        tensors = [torch.empty(p.shape, dtype=torch.float32, device=p.device)
                   for p in self.params]
        self.mover.from_buckets(self._gather(flats, torch.float32), tensors)
        out = {id(p): t for p, t in zip(self.params, tensors, strict=True)}
        if self.experts is not None:
            mine = {id(p): torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    for p in self.expert_params()}
            self.experts.gather(self._expert_pieces(flats, torch.float32), mine)
            out.update(mine)
        return out

    # ---------------------------------------------------------------- experts
    def expert_params(self) -> list[torch.nn.Parameter]:
        """This rank's local expert tensors (slice order, then packing order)."""
        if self.experts is None:
            return []
        return [p for sl in self.experts.slices for _, p in self.experts.items(sl.shard)]

    def _expert_pieces(self, flats: Sequence[torch.Tensor], dtype: torch.dtype
                       ) -> list[torch.Tensor]:
        """Per expert slice, this rank's values of it (``chunk`` long, zero padded) read from
        the flat per-group tensors ``flats``."""
        pieces = [torch.zeros(sl.chunk, dtype=dtype, device=self._dev())
                  for sl in self.experts.slices]
        for s in self.expert_segments:
            pieces[s.slice][s.a - s.lo:s.z - s.lo].copy_(
                flats[s.group][s.offset:s.offset + s.z - s.a])
        return pieces

    def _take_experts(self, flats: Sequence[torch.Tensor],
                      value: Callable[[torch.nn.Parameter], torch.Tensor]) -> None:
        """Write this rank's expert slice values of ``value(param)`` into ``flats``."""
        if self.experts is None:
            return
        for s in self.expert_segments:
            p = self.experts.items(self.experts.slices[s.slice].shard)[s.item][1]
            flats[s.group][s.offset:s.offset + s.z - s.a].copy_(
                value(p).reshape(-1)[s.a - s.at:s.z - s.at])

    def full_grads(self) -> dict[int, torch.Tensor]:
        """Every local parameter's reduced fp32 gradient (keyed by ``id``), assembled from
        the members' slices of this step (after the sync, before the update: tests compare
        the synchronised gradients); collective."""
        self.before_vote()
        assert self._ready is not None
        return self._full(self._ready[0])

    def _state_keys(self) -> tuple[str, ...]:
        keys = STATE_KEYS[self.config.optimizer]
        if self.config.optimizer == "sgd" and not self.config.sgd_momentum:
            return ()
        return keys

    def sharded_state_dict(self, model_sharded_state_dict: Any, is_loading: bool = False,
                           metadata: dict | None = None) -> dict[str, Any]:
        """What megatron's non-distributed optimizer of the same precision emits (module
        docstring); collective when saving."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        del metadata
        self._no_expert_checkpoints()
        self.settle("checkpoint")
        index = {id(p): i for i, p in enumerate(self.in_order)}
        full = {}
        for key in self._state_keys():
            if is_loading or not self._has_state(key):
                full[key] = {id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                             for p in self.params}
            else:
                full[key] = self._full([self.optimizer.state[m][key] for m in self.masters])
        step = self._step()
        state = {index[pid]: {"step": torch.tensor(float(step)),
                              **{k: full[k][pid] for k in full}}
                 for pid in index} if full else {}
        sd: dict[str, Any] = {"state": state, "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [index[id(p)] for p in self._group_params(gi)]}
            for gi, g in enumerate(self.optimizer.param_groups)]}
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.in_order)
        optim_state_to_sharding_state(sd, id_map, exclude_keys="step")
        if step:
            sd["state"]["common_step"] = step
        if not self.config.bf16:
            return sd
        masters = (self._full([m.data for m in self.masters]) if not is_loading else
                   {id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    for p in self.params})
        return {"optimizer": sd, "fp32_from_fp16_params": [
            [make_sharded_optimizer_tensor(id_map[index[id(p)]], masters[id(p)],
                                           prefix="optimizer.state.fp32_param")
             for p in self._group_params(gi)]
            for gi in range(len(self.masters))]}

    def _no_expert_checkpoints(self) -> None:
        if self.experts is not None:
            raise ValueError("checkpoint: train.distributed_optimizer=true with MoE experts "
                             "has no checkpoints yet (the expert slices' state is not saved)")

    def _group_params(self, gi: int) -> list[torch.nn.Parameter]:
        return [p for p in self.in_order if self.group_of[id(p)] == gi]

    def _has_state(self, key: str) -> bool:
        return all(key in self.optimizer.state.get(m, {}) for m in self.masters)

    def _step(self) -> int:
        for m in self.masters:
            st = self.optimizer.state.get(m, {})
            if "step" in st:
                return int(st["step"])
        return 0

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``sharded_state_dict(..., is_loading=True)`` returned, filled; the model's
        parameters must already be loaded (fp32 masters are taken from them). Collective."""
        self._no_expert_checkpoints()
        self.settle("load", publish=False)
        opt = state_dict["optimizer"] if self.config.bf16 else state_dict
        step = opt["state"].pop("common_step", None)
        index = {id(p): i for i, p in enumerate(self.in_order)}
        for key in self._state_keys():
            per = [opt["state"][index[id(p)]][key].reshape(p.shape) for p in self.params]
            flats, backs = self._take(per)
            for m, flat in zip((*self.masters, *self.backups), (*flats, *backs), strict=True):
                st = self.optimizer.state[m]
                st[key] = flat
                st["step"] = torch.tensor(float(step if step is not None else 0))
        if self.config.bf16:
            saved = {id(p): t for gi, ts in enumerate(state_dict["fp32_from_fp16_params"])
                     for p, t in zip(self._group_params(gi), ts, strict=True)}
            flats, backs = self._take([saved[id(p)].reshape(p.shape) for p in self.params])
            for m, flat in zip((*self.masters, *self.backups), (*flats, *backs), strict=True):
                m.data.copy_(flat)
        else:
            self.reload_model_params()


class _Gather:
    """The parameter all-gathers of one step, at most the engine's staging window
    (``staging_bytes``, or one bucket) in flight: the first window is launched at construction;
    iterating waits for the oldest, launches what then fits, and yields (bucket index, buffer)
    in bucket order, each once gathered. Only launched all-gathers are waited for, launched in
    the one canonical bucket order, so members never wait on each other in a cycle. The slices
    are copied out of ``flats`` at each launch: they must not change until the iteration ends."""

    def __init__(self, opt: ZeroOptimizer, flats: Sequence[torch.Tensor], dtype: torch.dtype
                 ) -> None:
        self.opt, self.flats, self.dtype = opt, flats, dtype
        self.per_bucket: list[list[_Segment]] = [[] for _ in opt.slices]
        for s in opt.segments:
            self.per_bucket[s.bucket].append(s)
        self.pending: deque[tuple[int, torch.Tensor, Any]] = deque()
        self.live = 0
        self.next = 0
        self._launch()

    def _size(self, i: int) -> int:
        sl = self.opt.slices[i]
        return sl.chunk * sl.size * self.dtype.itemsize

    def _launch(self) -> None:
        opt, window = self.opt, self.opt.engine.staging_bytes
        while self.next < len(opt.slices) and (
                not self.pending or self.live + self._size(self.next) <= window):
            i, sl = self.next, opt.slices[self.next]
            mine = torch.zeros(sl.chunk, dtype=self.dtype, device=opt._dev())
            for s in self.per_bucket[i]:
                mine[s.a - sl.start:s.z - sl.start].copy_(
                    self.flats[s.group][s.offset:s.offset + s.z - s.a])
            out = torch.empty(sl.chunk * sl.size, dtype=self.dtype, device=opt._dev())
            self.pending.append((i, out, opt.engine.comm.all_gather_into_tensor(
                out, mine, group=sl.group, async_op=True)))
            self.live += self._size(i)
            self.next += 1

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        while self.pending:
            j, out, work = self.pending.popleft()
            work.wait()
            self.live -= self._size(j)
            self._launch()
            yield j, out[:self.opt.engine.buckets[j].spec.numel]


def ring_ops(slices: Sequence[_Slice], outs: Sequence[torch.Tensor],
             ins: Sequence[torch.Tensor], me: int) -> list[p2p.Op]:
    """The redundancy's ring exchange of one rank (``me``, global): per bucket ``i`` send
    ``outs[i]`` to the group's next member, receive ``ins[i]`` from the previous one; sorted
    per peer by (bucket, sender), the same sequence on both sides of every pair (buckets are a
    restriction of one canonical order on every member)."""
    seq = []
    for i, (sl, out, inp) in enumerate(zip(slices, outs, ins, strict=True)):
        seq.append((sl.succ, i, me, "send", out))
        seq.append((sl.pred, i, sl.pred, "recv", inp))
    seq.sort(key=lambda x: (x[0], x[1], x[2]))
    return [p2p.Op(kind, t, peer) for peer, _, _, kind, t in seq]  # type: ignore[arg-type]


def _flats_of(bufs: Sequence[tuple[torch.Tensor | None, int]], segments: list[_Segment],
              sizes: list[int], device: torch.device | None) -> list[torch.Tensor]:
    """Flat per-group tensors of ``segments`` read from per-bucket buffers ``(buffer, bucket
    offset of its first element)``."""
    flats = [torch.empty(n, dtype=torch.float32, device=device) for n in sizes]
    for s in segments:
        buf, at = bufs[s.bucket]
        assert buf is not None
        flats[s.group][s.offset:s.offset + s.z - s.a].copy_(buf[s.a - at:s.z - at])
    return flats


def _inner_optimizer(config: OptimizerConfig, groups: list[dict[str, Any]], *,
                     cuda: bool = False) -> torch.optim.Optimizer:
    """The Adam/SGD ``get_megatron_optimizer`` builds, same kwargs: on CUDA megatron's own
    choice (``megatron.core.optimizer.Adam``: TE's or apex's FusedAdam, adam_w_mode as
    megatron sets it) or, without TE/apex, torch's fused CUDA Adam(W); on CPU torch's."""
    if config.optimizer == "adam":
        kw: dict[str, Any] = dict(lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_eps)
        if cuda:
            from megatron.core import optimizer as mopt

            fused = getattr(mopt, "Adam", None)
            if fused is not None and fused.__module__.split(".")[0] in ("transformer_engine",
                                                                         "apex"):
                return fused(groups, adam_w_mode=config.decoupled_weight_decay,  # type: ignore
                             **kw)
            kw["fused"] = True  # torch's single-kernel CUDA Adam(W)
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return cls(groups, **kw)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, weight_decay=config.weight_decay,
                               momentum=config.sgd_momentum)
    raise ValueError(f"train.optimizer={config.optimizer!r}: must be adam or sgd")
