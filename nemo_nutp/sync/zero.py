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

Pipeline stages with tied embeddings are the exception: the pipeline finalizer adds the other
stage's embedding gradient into ``main_grad`` after the sync, so there the buckets are
all-reduced as without this optimizer and the slices are taken from ``main_grad``.

fp32 models keep no masters between steps: they equal the parameters bit for bit and are taken
from them (holders -> owners) at each step, as megatron's optimizers view fp32 params.

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
from megatron.core.optimizer import _get_param_groups as megatron_param_groups

from . import p2p
from .engine import GradSyncEngine, _Bucket, _Param


@dataclass(frozen=True)
class _Slice:
    """This rank's slice ``[start, stop)`` of a bucket; ``chunk`` = padded slice length."""

    group: dist.ProcessGroup
    size: int
    index: int
    start: int
    stop: int
    chunk: int


@dataclass(frozen=True)
class _Segment:
    """Elements ``[a, z)`` of a bucket (inside one piece of parameter ``param``) that sit at
    ``offset`` of the flat master of param group ``group``."""

    bucket: int
    a: int
    z: int
    group: int
    offset: int


def bucket_slice(numel: int, size: int, index: int) -> tuple[int, int, int]:
    """(start, stop, chunk): member ``index`` of ``size`` keeps ``[start, stop)``; every slice
    is padded to ``chunk`` elements for the all-gather."""
    chunk = max(1, math.ceil(numel / size))
    return min(numel, index * chunk), min(numel, (index + 1) * chunk), chunk


class BucketMover:
    """Moves per-parameter tensors (shaped like the local parameters) to the sync layout's
    buckets and back, over the engine's reshard messages; the data path of the gradient sync
    reused for parameters and optimizer state."""

    def __init__(self, engine: GradSyncEngine) -> None:
        self.engine = engine
        self.where = {id(b): i for i, b in enumerate(engine.buckets)}

    def to_buckets(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Full bucket buffers of ``tensors`` (one per entry of ``engine.order``): holders send
        the units they do not own to their owner. Replicas hold the same values, so no reduction."""
        eng = self.engine
        bufs = [torch.zeros(b.spec.numel, dtype=dtype, device=_device(tensors))
                for b in eng.buckets]
        ins = [torch.empty(m.spec.numel, dtype=dtype, device=_device(tensors))
               for m in eng.in_msgs]
        outs = []
        for m in eng.out_msgs:
            buf = torch.empty(m.spec.numel, dtype=dtype, device=_device(tensors))
            for param, lo, hi, off, n in m.spec.pieces:
                eng._read(eng.order[param], lo, hi, buf[off:off + n], tensors[param])
            outs.append(buf)
        works = p2p.backend().exchange(eng.pair_ops(outs, ins, back=False))
        for i, e in enumerate(eng.order):
            for b, pc in e.pieces:
                seg = bufs[self.where[id(b)]][pc.offset:pc.offset + pc.numel]
                self._local(e, pc, seg, tensors[i], write=False)
        for work in works:
            work.wait()
        for m, buf in zip(eng.in_msgs, ins, strict=True):
            for b, off, moff, n in m.targets:
                bufs[self.where[id(b)]][off:off + n].copy_(buf[moff:moff + n])
        return bufs

    def from_buckets(self, bufs: list[torch.Tensor | None], tensors: list[torch.Tensor]) -> None:
        """Write full bucket buffers into ``tensors``: owners write their own units and return
        the others to their holders; replicated values reach the leader's TP group."""
        eng = self.engine
        dtype, device = tensors[0].dtype, tensors[0].device
        outs = [torch.empty(m.spec.numel, dtype=dtype, device=device) for m in eng.out_msgs]
        ins = []
        for m in eng.in_msgs:
            buf = torch.empty(m.spec.numel, dtype=dtype, device=device)
            for b, off, moff, n in m.targets:
                buf[moff:moff + n].copy_(bufs[self.where[id(b)]][off:off + n])  # type: ignore
            ins.append(buf)
        works = p2p.backend().exchange(eng.back_ops(outs, ins))
        for i, e in enumerate(eng.order):
            for b, pc in e.pieces:
                src = bufs[self.where[id(b)]]
                assert src is not None
                self._local(e, pc, src[pc.offset:pc.offset + pc.numel], tensors[i], write=True)
        for work in works:
            work.wait()
        for m, buf in zip(eng.out_msgs, outs, strict=True):
            for param, lo, hi, off, n in m.spec.pieces:
                eng._write(eng.order[param], lo, hi, buf[off:off + n], tensors[param])
        self._share_replicated(tensors)

    def from_gathered(self, gathered: Iterable[tuple[int, torch.Tensor]],
                      tensors: list[torch.Tensor]) -> None:
        """``from_buckets`` over buckets that arrive one by one (``(bucket index, buffer)`` in
        bucket order) and are dropped once written: owners write their own units at once and
        copy the returned ones into the (smaller) message buffers; then the same one exchange
        of the return path as ``from_buckets``."""
        eng = self.engine
        dtype, device = tensors[0].dtype, tensors[0].device
        ins = [torch.empty(m.spec.numel, dtype=dtype, device=device) for m in eng.in_msgs]
        slot = {id(m): j for j, m in enumerate(eng.in_msgs)}
        for i, buf in gathered:
            b = eng.buckets[i]
            for pc in b.spec.pieces:
                self._local(eng.order[pc.param], pc, buf[pc.offset:pc.offset + pc.numel],
                            tensors[pc.param], write=True)
            for m in b.in_msgs:
                for tb, off, moff, n in m.targets:
                    if tb is b:
                        ins[slot[id(m)]][moff:moff + n].copy_(buf[off:off + n])
        outs = [torch.empty(m.spec.numel, dtype=dtype, device=device) for m in eng.out_msgs]
        for work in p2p.backend().exchange(eng.back_ops(outs, ins)):
            work.wait()
        for m, buf in zip(eng.out_msgs, outs, strict=True):
            for param, lo, hi, off, n in m.spec.pieces:
                eng._write(eng.order[param], lo, hi, buf[off:off + n], tensors[param])
        self._share_replicated(tensors)

    def _local(self, e: _Param, pc: Any, seg: torch.Tensor, t: torch.Tensor, *,
               write: bool) -> None:
        if e.kind is None:
            if write:
                t.view(-1).copy_(seg)
            else:
                seg.copy_(t.view(-1))
            return
        assert e.units is not None
        lo, hi = max(pc.lo, e.units[0]), min(pc.hi, e.units[1])
        if hi <= lo:
            return
        part = seg[(lo - pc.lo) * e.numel_unit:(hi - pc.lo) * e.numel_unit]
        if write:
            self.engine._write(e, lo, hi, part, t)
        else:
            self.engine._read(e, lo, hi, part, t)

    def _share_replicated(self, tensors: list[torch.Tensor]) -> None:
        """Without sequence parallelism only the TP-rank-0 leader holds replicated values in
        its buckets: broadcast them in the TP group (the engine's rule for gradients)."""
        eng = self.engine
        idx = [i for i, e in enumerate(eng.order) if e.kind is None]
        if eng.stage_mode or eng.ctx.degree == 1 or not idx:
            return
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        dist.broadcast(flat, src=eng.ranks[0], group=eng.groups.tp)
        off = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].view(-1).copy_(flat[off:off + n])
            off += n


def _device(tensors: list[torch.Tensor]) -> torch.device | None:
    return tensors[0].device if tensors else None


STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class ZeroOptimizer:
    """ZeRO-1 over the sync owner groups (module docstring); the interface ``train/step.py``,
    ``train/loop.py`` and ``checkpoint/store.py`` use of megatron's optimizers."""

    nutp_zero = True

    def __init__(self, model: Any, config: OptimizerConfig) -> None:
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
        self.segments, sizes = self._segments(self.group_of, len(groups))
        self.sizes = sizes
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
        self.keep_masters = self.param_dtype != torch.float32
        self.masters = [torch.nn.Parameter(torch.empty(n, dtype=torch.float32,
                                                       device=self._dev()))
                        for n in sizes]
        self._load_masters()
        if not self.keep_masters:
            self._free_masters()
        torch_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [m]}
                        for g, m in zip(groups, self.masters, strict=True)]
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
        return _Slice(b.group, size, index, start, stop, chunk)

    def _segments(self, group_of: dict[int, int], n_groups: int
                  ) -> tuple[list[_Segment], list[int]]:
        """This rank's slice elements, per bucket and piece, placed in its param group's flat
        master (in bucket order)."""
        sizes = [0] * n_groups
        out = []
        for i, (b, sl) in enumerate(zip(self.engine.buckets, self.slices, strict=True)):
            for pc in b.spec.pieces:
                a, z = max(sl.start, pc.offset), min(sl.stop, pc.offset + pc.numel)
                if z <= a:
                    continue
                g = group_of[id(self.engine.order[pc.param].param)]
                out.append(_Segment(i, a, z, g, sizes[g]))
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
        return list(self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Take this rank's slices of the reduced buckets as the masters' fp32 gradients
        (fp32 models: and the masters from the parameters; collective)."""
        if not self.keep_masters:
            self._load_masters()
        grads = [torch.empty_like(m) for m in self.masters]
        eng = self.engine
        # (buffer, offset of its first element in the bucket) per bucket
        bufs: list[tuple[torch.Tensor | None, int]] = [(b.buf, 0) for b in eng.buckets]
        if self.scatter:
            bufs = [(b.out, sl.start) for b, sl in zip(eng.buckets, self.slices, strict=True)]
        elif self.reread:
            full = self.mover.to_buckets([p.main_grad for p in self.params],  # type: ignore
                                         self.params[0].main_grad.dtype)  # type: ignore
            bufs = [(t, 0) for t in full]
        for s in self.segments:
            buf, at = bufs[s.bucket]
            if buf is None:
                raise RuntimeError("distributed optimizer: the gradient sync kept no reduced "
                                   "buckets (finish_grad_sync must run before the step)")
            grads[s.group][s.offset:s.offset + s.z - s.a].copy_(buf[s.a - at:s.z - at])
        self.engine.release_buckets()
        for m, g in zip(self.masters, grads, strict=True):
            m.grad = g
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Update the slices, all-gather them per bucket, reshard parameters to holders."""
        self.optimizer.step()
        # Bucket by bucket within the engine's staging window: never a full param-dtype copy
        # of all buckets at once.
        self.mover.from_gathered(self._gathered(self.masters, self.param_dtype),
                                 [p.data for p in self.params])
        if not self.keep_masters:
            self._free_masters()
        return True

    def _free_masters(self) -> None:
        for m in self.masters:
            m.grad = None
            m.data = torch.empty(0, dtype=torch.float32, device=m.device)

    def _gather(self, flats: Sequence[torch.Tensor], dtype: torch.dtype
                ) -> list[torch.Tensor | None]:
        """Every bucket assembled from its members' slices (``flats``: per param group, this
        rank's flat slice values), launched in the canonical bucket order."""
        per_bucket: list[list[_Segment]] = [[] for _ in self.slices]
        for s in self.segments:
            per_bucket[s.bucket].append(s)
        works = []
        for segs, sl in zip(per_bucket, self.slices, strict=True):
            mine = torch.zeros(sl.chunk, dtype=dtype, device=self._dev())
            for s in segs:
                mine[s.a - sl.start:s.z - sl.start].copy_(flats[s.group][s.offset:
                                                                          s.offset + s.z - s.a])
            out = torch.empty(sl.chunk * sl.size, dtype=dtype, device=self._dev())
            works.append((out, dist.all_gather_into_tensor(out, mine, group=sl.group,
                                                           async_op=True)))
        bufs: list[torch.Tensor | None] = []
        for (out, work), b in zip(works, self.engine.buckets, strict=True):
            work.wait()  # type: ignore[union-attr]
            bufs.append(out[:b.spec.numel])
        return bufs

    def _gathered(self, flats: Sequence[torch.Tensor], dtype: torch.dtype
                  ) -> Iterator[tuple[int, torch.Tensor]]:
        """``_gather`` with at most the engine's staging window (``staging_bytes``, or one
        bucket) of all-gathers in flight: yields (bucket index, buffer) in bucket order, each
        once gathered; the oldest is waited for before the next would exceed the window.
        Only launched all-gathers are waited for, launched in the one canonical bucket order,
        so members never wait on each other in a cycle."""
        per_bucket: list[list[_Segment]] = [[] for _ in self.slices]
        for s in self.segments:
            per_bucket[s.bucket].append(s)
        pending: deque[tuple[int, torch.Tensor, Any]] = deque()
        live = 0
        window = self.engine.staging_bytes
        for i, (segs, sl) in enumerate(zip(per_bucket, self.slices, strict=True)):
            size = sl.chunk * sl.size * dtype.itemsize
            while pending and live + size > window:
                j, out, work = pending.popleft()
                work.wait()
                live -= out.numel() * out.element_size()
                yield j, out[:self.engine.buckets[j].spec.numel]
            mine = torch.zeros(sl.chunk, dtype=dtype, device=self._dev())
            for s in segs:
                mine[s.a - sl.start:s.z - sl.start].copy_(flats[s.group][s.offset:
                                                                          s.offset + s.z - s.a])
            out = torch.empty(sl.chunk * sl.size, dtype=dtype, device=self._dev())
            pending.append((i, out, dist.all_gather_into_tensor(out, mine, group=sl.group,
                                                                async_op=True)))
            live += size
        while pending:
            j, out, work = pending.popleft()
            work.wait()
            yield j, out[:self.engine.buckets[j].spec.numel]

    def _take(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's flat slices (per param group) of per-parameter tensors (engine order)."""
        bufs = self.mover.to_buckets(tensors, torch.float32)
        flats = [torch.empty(n, dtype=torch.float32, device=self._dev()) for n in self.sizes]
        for s in self.segments:
            flats[s.group][s.offset:s.offset + s.z - s.a].copy_(bufs[s.bucket][s.a:s.z])
        return flats

    @torch.no_grad()
    def reload_model_params(self, state_dict: Any = None) -> None:
        """Masters from the model's current parameters (after a weights-only load; fp32 models
        take them at every step anyway); collective."""
        del state_dict
        if self.keep_masters:
            self._load_masters()

    def _load_masters(self) -> None:
        for m, flat in zip(self.masters, self._take([p.data for p in self.params]), strict=True):
            m.data = flat

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps between steps: fp32 masters (bf16) and
        the inner optimizer's state."""
        n = sum(m.numel() * m.element_size() for m in self.masters)
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
        return {id(p): t for p, t in zip(self.params, tensors, strict=True)}

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
        opt = state_dict["optimizer"] if self.config.bf16 else state_dict
        step = opt["state"].pop("common_step", None)
        index = {id(p): i for i, p in enumerate(self.in_order)}
        for key in self._state_keys():
            per = [opt["state"][index[id(p)]][key].reshape(p.shape) for p in self.params]
            for m, flat in zip(self.masters, self._take(per), strict=True):
                st = self.optimizer.state[m]
                st[key] = flat
                st["step"] = torch.tensor(float(step if step is not None else 0))
        if self.config.bf16:
            saved = {id(p): t for gi, ts in enumerate(state_dict["fp32_from_fp16_params"])
                     for p, t in zip(self._group_params(gi), ts, strict=True)}
            flats = self._take([saved[id(p)].reshape(p.shape) for p in self.params])
            for m, flat in zip(self.masters, flats, strict=True):
                m.data.copy_(flat)
        else:
            self.reload_model_params()


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
