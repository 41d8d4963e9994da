"""Import Megatron-Bridge (0.6.2) without Transformer Engine / NVRx, and run its ``train()`` on CPU.

Contract:
- :func:`install_import_shim` (always, CUDA or not, when TE / NVRx are absent) gives exactly the
  modules in ``SCOPED_STUBS`` stub names for the packages they import at module level only as
  type hints or ``isinstance`` targets. The stubs are visible only inside those modules' globals
  (their ``__import__``), never in ``sys.modules``: a global ``transformer_engine`` would switch
  ~15 megatron-core modules onto TE code paths.
- :func:`apply_bridge_cpu_patches` does nothing where CUDA is available. Without CUDA it
  redirects Bridge's CUDA-only calls, each named by module and function in ``CPU_PATCHES``
  (the test ``tests/integrations/test_bridge_shim.py`` fails when the pinned Bridge no longer
  has a patched function, or the function no longer contains the CUDA call the patch is for).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

SCOPED_STUBS: dict[str, tuple[str, ...]] = {
    # ``te.ops.Sequential`` etc. in return annotations, ``te.Linear`` in isinstance checks (LoRA).
    "megatron.bridge.peft.lora_layers": ("transformer_engine",),
    # ``CallWrapper`` is a type hint of ``_pretrain``.
    "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext",),
}
"""Module (``pkg.*``: every module under ``pkg``) -> packages it sees as stubs when they are not
installed."""


class _Stub(types.ModuleType):
    """A placeholder package: every attribute is a sub-stub, callable as a class that is never
    instantiated by the code paths used here (``isinstance`` against it is False)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "nemo_nutp.compat.bridge_cpu stub (not installed)")
        self.__path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value: Any = type(name, (), {"__module__": self.__name__,
                                         "__init__": _not_installed(self.__name__, name)})
        else:
            value = _Stub(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A lower-case name used as a decorator (``@stateless``, ``@stateless(...)``): identity."""
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


def _not_installed(module: str, name: str) -> Any:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{module}.{name}: {module.split('.')[0]} is not installed")
    return init


def _is_installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _scoped_import(stubs: dict[str, _Stub]) -> Any:
    real = builtins.__import__

    def imp(name: str, globals: Any = None, locals: Any = None,
            fromlist: Sequence[str] = (), level: int = 0) -> Any:
        for package, stub in stubs.items():
            if level == 0 and (name == package or name.startswith(package + ".")):
                if not fromlist and "." not in package:
                    return stub  # ``import a.b`` binds ``a``
                out: Any = stub
                for part in name[len(package):].split(".")[1:]:
                    out = getattr(out, part)
                return out
        return real(name, globals, locals, fromlist, level)

    return imp


class _ScopedLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, packages: tuple[str, ...]) -> None:
        self.inner, self.packages = inner, packages

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        stubs = {p: _Stub(p) for p in self.packages}
        scoped = dict(vars(builtins))
        scoped["__import__"] = _scoped_import(stubs)
        module.__dict__["__builtins__"] = scoped
        self.inner.exec_module(module)


class _ScopedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        wanted = [p for key, pkgs in SCOPED_STUBS.items() for p in pkgs
                  if key == fullname or (key.endswith(".*") and fullname.startswith(key[:-1]))]
        packages = tuple(p for p in dict.fromkeys(wanted) if not _is_installed(p))
        if not packages:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ScopedLoader(spec.loader, packages)
        return spec


_FINDER = _ScopedFinder()


def install_import_shim() -> None:
    """Make the modules in ``SCOPED_STUBS`` importable without their missing packages
    (idempotent; modules already imported are not re-imported)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


TORCH_PROXY_MODULES: tuple[tuple[str, str], ...] = (
    # (module, the functions whose CUDA calls need the CPU ``torch`` proxy of compat.cpu)
    ("megatron.bridge.training.utils.train_utils",
     "reduce_max_stat_across_model_parallel_group logical_and_across_model_parallel_group "
     "training_log"),  # current_device() / device="cuda" scalars, total_loss_dict
    ("megatron.bridge.training.train", "train_step maybe_synchronize_training_step "
     "save_checkpoint_and_time checkpoint_and_decide_exit"),  # empty_cache, synchronize, flags
    ("megatron.core.timers", "Timer.start Timer.stop Timers._get_elapsed_time_all_ranks"),
    ("megatron.bridge.data.loaders", "build_train_valid_test_data_loaders"),  # "cuda" flags
    ("megatron.training.models.dist_utils", "_ddp_wrap"),  # DDP built inside a CUDA stream
    ("megatron.bridge.training.eval", "evaluate"),  # empty_cache, synchronize, "cuda" flag
)
"""Modules whose global ``torch`` becomes compat.cpu's proxy without CUDA; the named functions
are what needs it (checked to still exist and still call CUDA, tests/integrations)."""

CUDA_TENSOR_FUNCS: tuple[tuple[str, str], ...] = (
    # ``val.cuda(non_blocking=True)`` per batch tensor: identity on CPU while it runs.
    ("megatron.bridge.training.gpt_step", "get_batch_from_iterator"),
    # ``torch.tensor([0.0, 0.0]).cuda()``: the validation loss sums (evaluation in train()).
    ("megatron.bridge.training.eval", "evaluate"),
)

NCCL_GROUP_FUNCS: tuple[tuple[str, str], ...] = (
    # ``HyperCommGrid(..., backend="nccl")`` and ``new_subgroups_by_enumeration(...,
    # backend="nccl")``: Bridge's own process groups (``use_decentralized_pg``); gloo on CPU.
    ("megatron.bridge.training.initialize", "_create_pg_collection"),
)

_bridge_patched: list[str] = []


def _tensor_cuda_is_identity(fn: Any) -> Any:
    import functools

    import torch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign, assignment]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = real  # type: ignore[method-assign]

    wrapper.__nutp_cpu_patch__ = True  # type: ignore[attr-defined]
    return wrapper


def _groups_are_gloo(fn: Any) -> Any:
    """``fn`` with every subgroup it creates on gloo, whatever backend it asks for."""
    import functools

    import torch.distributed as dist

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real = dist.new_subgroups_by_enumeration

        def gloo(*a: Any, **k: Any) -> Any:
            k["backend"] = "gloo"
            return real(*a, **k)

        dist.new_subgroups_by_enumeration = gloo
        try:
            return fn(*args, **kwargs)
        finally:
            dist.new_subgroups_by_enumeration = real

    wrapper.__nutp_cpu_patch__ = True  # type: ignore[attr-defined]
    return wrapper


def apply_bridge_cpu_patches() -> list[str]:
    """Redirect Bridge's CUDA-only calls to CPU (nothing where CUDA is available); returns what
    was patched. megatron-core's own patches (compat.cpu) are applied first."""
    import torch

    from .cpu import CpuStream, TorchProxy, apply_cpu_patches

    if torch.cuda.is_available():
        return []
    if _bridge_patched:
        return list(_bridge_patched)
    install_import_shim()
    done = apply_cpu_patches()
    proxy = TorchProxy()
    proxy.cuda.Stream = CpuStream  # _ddp_wrap: ``torch.cuda.Stream()``; waits are no-ops
    for modname, _funcs in TORCH_PROXY_MODULES:
        module = importlib.import_module(modname)
        module.torch = proxy  # type: ignore[attr-defined]
        done.append(f"{modname}.torch")
    for modname, func in CUDA_TENSOR_FUNCS:
        module = importlib.import_module(modname)
        setattr(module, func, _tensor_cuda_is_identity(getattr(module, func)))
        done.append(f"{modname}.{func}")
    for modname, func in NCCL_GROUP_FUNCS:
        module = importlib.import_module(modname)
        setattr(module, func, _groups_are_gloo(getattr(module, func)))
        done.append(f"{modname}.{func}")
    _bridge_patched.extend(done)
    return list(done)
