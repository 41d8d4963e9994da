"""Run megatron-core 0.16.1 on CPU/gloo by redirecting its hard-coded CUDA calls.

Contract:
- On a machine where ``torch.cuda.is_available()`` is True, :func:`apply_cpu_patches` does nothing
  and returns ``[]``; no object anywhere is replaced.
- Without CUDA it patches (idempotently) only megatron-core; torch itself is only touched by 3.,
  and only for the duration of the wrapped call:
  1. ``torch`` as seen by the modules in ``_SHIMMED_MODULES`` becomes a thin proxy whose
     ``cuda.current_device()`` is the CPU device, ``cuda.synchronize``/``empty_cache`` are no-ops,
     the CUDA RNG calls use the CPU generator (so ``model_parallel_cuda_manual_seed(s)`` also
     reseeds the CPU default generator with ``s``), and tensor factories map ``device='cuda'``
     to CPU. The real ``torch`` module, and every megatron module not listed, is untouched.
  2. ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state`` read/write the CPU
     generator, so the stock ``CudaRNGStatesTracker`` (``model_parallel_cuda_manual_seed``) works.
  3. Functions that assert ``Tensor.type() == 'torch.cuda.FloatTensor'`` (clip_grads, fp16 and
     distributed optimizers) see CUDA type names for CPU tensors while they run.
- MoE (megatron-core 0.19; 0.16's MoE needs TE): the modules in ``_MOE_SHIMMED_MODULES`` get the
  same proxy, whose ``cuda.Stream``/``cuda.Event`` are the synchronous :class:`CpuStream` /
  :class:`CpuEvent` (the all-to-all dispatcher's device-to-host stream, the MoE layer's and shared
  experts' side streams) and whose ``current_device()`` places the router's weights and aux-loss
  buffers on CPU. Modules that do not exist in the installed megatron-core are skipped. The
  all-to-all dispatcher's ``maybe_move_tensor_to_cpu`` (its device-to-host copy of the split
  sizes, which turns them into numpy for ``all_to_all_single``) also converts CPU tensors
  (:func:`_splits_to_host`): on CUDA only CUDA tensors are converted, and on CPU they would
  reach ``all_to_all_single`` as tensors, which it refuses (expert parallelism > 1 only).
- GPTModel needs an explicit attention mask on CPU (no fused/flash kernels):
  :func:`cpu_attention_mask`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

_CPU = torch.device("cpu")
# torch factories whose ``device=`` argument megatron sets to a CUDA literal or current_device().
_FACTORIES: tuple[str, ...] = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor")
_FACTORIES += (
    "empty_strided",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "randn",
    "rand",
)
# Modules whose global name ``torch`` is replaced by the proxy (each line: why).
_SHIMMED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # token counters on device="cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers on current_device()
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers on current_device()
    "megatron.core.distributed.distributed_data_parallel",  # synchronize() in buffer free/alloc
    "megatron.core.utils",  # GlobalMemoryBuffer current_device(); l2-norm fallback device="cuda"
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq on current_device()
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",  # YaRN's, moved there
    "megatron.core.models.gpt.gpt_model",  # current_device() buffers
    "megatron.core.transformer.attention",  # inference/KV buffers on current_device()
    "megatron.core.transformer.utils",  # the sliding-window mask on device="cuda"
    "megatron.core.tensor_parallel.layers",  # sequence-parallel all-gather buffers
    "megatron.core.tensor_parallel.mappings",  # sequence-parallel gather/scatter buffers
    "megatron.core.tensor_parallel.utils",  # split/gather buffers on current_device()
    "megatron.core.tensor_parallel.random",  # CUDA RNG get/set/manual_seed -> CPU generator
    "megatron.core.optimizer.clip_grads",  # device='cuda' norm/zero tensors
    "megatron.core.optimizer.optimizer",  # device='cuda' found_inf/_scale tensors
    "megatron.core.optimizer.grad_scaler",  # device='cuda' scale tensors
    "megatron.core.optimizer.distrib_optimizer",  # shard buffers on current_device()
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # device='cuda' flags
    "megatron.core.dist_checkpointing.strategies.fully_parallel",  # torch.cuda.synchronize()
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # torch.cuda.synchronize()
    "megatron.core.dist_checkpointing.strategies.async_utils",  # current_device() flags
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",  # torch.cuda.synchronize()
    "megatron.core.dist_checkpointing.exchange_utils",  # empty_like(device="cuda")
)
# MoE modules given the proxy where present (megatron-core 0.19.x; each line: why).
_MOE_SHIMMED_MODULES = (
    "megatron.core.transformer.moe.token_dispatcher",  # cuda.Stream() for device-to-host copies
    "megatron.core.transformer.moe.router",  # weights, aux-loss buffers on current_device()
    "megatron.core.transformer.moe.moe_layer",  # cuda.Stream/Event, current_stream() waits
    "megatron.core.transformer.moe.moe_utils",  # record_stream(current_stream())
    "megatron.core.transformer.moe.shared_experts",  # cuda.Stream() of overlapped shared experts
    "megatron.core.transformer.multi_token_prediction",  # MTP loss tracker on current_device()
)
# (module, qualified attribute) run with CUDA type names for CPU tensors (why: Tensor.type() check).
_CUDA_TYPE_NAME_FUNCS = (
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),  # imported by name
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups",
    ),
)

_patched: list[str] = []


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``'cuda'``, ``'cuda:0'``, ``torch.device('cuda')``) to CPU."""
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs CUDA
        return fn(*args, **kwargs)

    return wrapper


class CpuStream:
    """The one (synchronous) CPU "stream": waits are no-ops. megatron-core 0.19's bucket groups
    ask for ``torch.cuda.current_stream()`` on every grad sync."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> CpuEvent:
        return CpuEvent() if event is None else event


class CpuEvent:
    """A CUDA event on the one synchronous CPU "stream": always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _cpu_stream(*args: Any, **kwargs: Any) -> CpuStream:
    return CpuStream()


class _CudaProxy(types.SimpleNamespace):
    """``torch.cuda`` as megatron sees it on CPU; unknown names fall through to ``torch.cuda``."""

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> CpuStream:
        return CpuStream()

    Stream = staticmethod(_cpu_stream)
    Event = CpuEvent

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        if name == "random":
            return self  # torch.cuda.random.get_rng_state(...)
        return getattr(torch.cuda, name)


class TorchProxy(types.ModuleType):
    """``torch`` as megatron sees it on CPU; everything not overridden is the real torch."""

    def __init__(self) -> None:
        super().__init__("torch", "CPU proxy of torch for megatron-core (nemo_nutp.compat.cpu)")
        self.cuda = _CudaProxy()
        for name in _FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _splits_to_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return fn(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return wrapper


def _cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


class _DropCpuRngWarning(logging.Filter):
    """The CPU generator *is* the tracked generator here, so drawing inside fork() is expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    out = _REAL_TENSOR_TYPE(self, *args, **kwargs)
    if not args and not kwargs and self.device.type == "cpu" and isinstance(out, str):
        return out.replace("torch.", "torch.cuda.", 1)
    return out


_REAL_TENSOR_TYPE = torch.Tensor.type


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """Temporarily report ``torch.cuda.FloatTensor`` etc. for CPU tensors (not thread-safe)."""
    torch.Tensor.type = _cuda_type_name  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.Tensor.type = _REAL_TENSOR_TYPE  # type: ignore[method-assign]


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper.__nutp_cpu_patch__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_attr(module: types.ModuleType, qualname: str) -> None:
    *owner_path, name = qualname.split(".")
    owner: Any = module
    for part in owner_path:
        owner = getattr(owner, part)
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if isinstance(raw, classmethod):
        setattr(owner, name, classmethod(_with_cuda_type_names(raw.__func__)))
    elif isinstance(raw, staticmethod):
        setattr(owner, name, staticmethod(_with_cuda_type_names(raw.__func__)))
    else:
        setattr(owner, name, _with_cuda_type_names(raw))


def apply_cpu_patches() -> list[str]:
    """Patch megatron-core for CPU/gloo; returns what was patched ([] when CUDA is available)."""
    if torch.cuda.is_available():
        return []
    if _patched:
        return list(_patched)
    proxy = TorchProxy()
    done: list[str] = []
    for modname in _SHIMMED_MODULES:
        module = importlib.import_module(modname)
        module.torch = proxy  # type: ignore[attr-defined]
        done.append(f"{modname}.torch")
    for modname in _MOE_SHIMMED_MODULES:
        if importlib.util.find_spec(modname) is None:
            continue
        module = importlib.import_module(modname)
        module.torch = proxy  # type: ignore[attr-defined]
        done.append(f"{modname}.torch")
        if hasattr(module, "maybe_move_tensor_to_cpu") and modname.endswith("token_dispatcher"):
            module.maybe_move_tensor_to_cpu = _splits_to_host(  # type: ignore[attr-defined]
                module.maybe_move_tensor_to_cpu)
            done.append(f"{modname}.maybe_move_tensor_to_cpu")
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _cpu_get_rng_state  # type: ignore[attr-defined]
    random._set_cuda_rng_state = _cpu_set_rng_state  # type: ignore[attr-defined]
    logging.getLogger(random.__name__).addFilter(_DropCpuRngWarning())
    done += [f"{random.__name__}._get_cuda_rng_state", f"{random.__name__}._set_cuda_rng_state"]
    for modname, qualname in _CUDA_TYPE_NAME_FUNCS:
        _wrap_attr(importlib.import_module(modname), qualname)
        done.append(f"{modname}.{qualname}")
    _patched.extend(done)
    return list(done)


def is_patched() -> bool:
    """True once :func:`apply_cpu_patches` has patched megatron-core in this process."""
    return bool(_patched)


def cpu_attention_mask(seq_len: int) -> torch.Tensor:
    """Causal mask in megatron convention (True = masked), shape ``[1, 1, seq_len, seq_len]``."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
