"""megatron-core's initialisation, globally consistent, generated per unit block.

Contract:
* The distribution of a parameter follows megatron's GPT defaults (``init_std``): weight
  matrices N(0, std); each layer's output projections (``linear_proj``, ``linear_fc2``)
  N(0, std / sqrt(2 * num_layers)) (``scaled_init_method_normal``); biases 0; norm weights 1,
  norm biases 0; with ``layernorm_zero_centered_gamma`` norm weights 0 (the norm scales by
  ``1 + weight``).
* Values are a pure function of (seed, normalized name, global unit, element): every rank of
  every degree and unit assignment that holds unit ``u`` gets the same bits for it, and the
  TP1 tensor (``init_global``) is exactly the assembly of the shards. ``name`` decides the
  distribution and the random stream, ``kind`` only the layout; names must be the same on
  every replica (global layer numbers, ``module.`` prefixes are stripped).
* A rank's time and extra memory scale with its shard, not the global tensor: the canonical
  unit-major element sequence is cut into fixed *pieces* of at most ``piece_elems`` elements
  (whole units when a unit fits, else row blocks of one unit's ``unit_view``), each drawn from
  its own ``torch.Generator`` seeded by a blake2b hash of (seed, name, piece id). A rank draws
  only the pieces that overlap its units; peak extra memory is one piece (4 MiB in fp32).
* ``piece_elems`` is part of the definition of the init: changing it changes the values. So is
  torch's CPU normal kernel: every rank must run the same torch build on the same CPU kernel
  path (measured with torch 2.13: ``ATEN_CPU_CAPABILITY`` avx2 and avx512 give the same bits,
  ``default`` different ones; so a job mixing x86 and aarch64 hosts would not agree).
* Random values are drawn in fp32 on the CPU into a fresh contiguous tensor and then copied
  (and cast) into the parameter, whatever its dtype or device: torch's CPU normal kernel gives
  different values for contiguous and strided outputs, so never draw into a view.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..layout.specs import ModelDims
from ..layout.units import PARAM_KINDS, global_shape, local_shape, num_units, unit_geometry

PIECE_ELEMS = 1 << 20
"""Elements per random piece (fp32: 4 MiB); part of the init's definition."""

_SCALED = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def normalize_name(name: str) -> str:
    """Parameter name without leading ``module.`` wrappers (DDP, Float16Module, ...)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _is_norm(name: str) -> bool:
    # ``layer_norm_weight``/``layer_norm_bias``: TE's fused layernorm-linear names.
    return "layernorm" in name or "layer_norm" in name


def init_std(name: str, dims: ModelDims, std: float) -> float | None:
    """Std of megatron's N(0, .) init of parameter ``name``; None for constants (see
    ``constant_value``). Raises ``ValueError`` for a name no rule covers."""
    n = normalize_name(name)
    if _is_norm(n) or n.endswith("bias"):
        return None
    if n.endswith(_SCALED):
        return std / math.sqrt(2.0 * dims.num_layers)
    if n.endswith("weight"):
        return std
    raise ValueError(f"{name}: no init rule (expected a weight, bias or norm parameter)")


def constant_value(name: str, *, zero_centered_gamma: bool = False) -> float:
    """Value of a constant-initialised parameter: 1 for norm weights (0 with
    ``layernorm_zero_centered_gamma``, as megatron's and TE's norms initialise them), 0 for
    biases."""
    n = normalize_name(name)
    if n.endswith("bias"):
        return 0.0
    if _is_norm(n) and n.endswith("weight"):
        return 0.0 if zero_centered_gamma else 1.0
    raise ValueError(f"{name}: not a constant-initialised parameter (norm weight or bias)")


def unit_view(kind: str | None, dims: ModelDims, local: torch.Tensor) -> torch.Tensor:
    """Strided view (no copy) ``(n_local, R, C)`` of a rank-local megatron tensor of ``kind``
    holding ``n_local`` consecutive units: ``view[i].reshape(-1)`` lists unit i's elements in
    canonical order (as ``layout.units.global_index``). ``kind=None``: each row is a unit."""
    if kind is None:
        return local.view(local.shape[0], 1, -1)
    shape, per_unit, half = unit_geometry(kind, dims)
    axis = PARAM_KINDS[kind].axis
    n = local.shape[axis] // (per_unit * (2 if half else 1))
    if half:  # megatron keeps [gate rows of local units; up rows of local units]
        assert per_unit == 1, f"{kind}: gated halves with {per_unit} rows per unit"
        if local.dim() == 1:
            return local.view(2, n).t().unsqueeze(-1)
        return local.view(2, n, shape[1]).transpose(0, 1)
    if local.dim() == 1:
        return local.view(n, 1, per_unit)
    if axis == 0:
        return local.view(n, per_unit, shape[1])
    return local.view(shape[0], n, per_unit).permute(1, 0, 2)


def piece_key(seed: int, name: str, piece: str) -> int:
    """Stable 63-bit generator seed of one piece (blake2b, independent of Python's hash)."""
    digest = hashlib.blake2b(f"{seed}\x1f{name}\x1f{piece}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _normal(key: int, count: int, std: float) -> torch.Tensor:
    """``count`` N(0, std) fp32 values on the CPU, drawn into a fresh contiguous tensor."""
    gen = torch.Generator().manual_seed(key)
    return torch.randn(count, generator=gen, dtype=torch.float32).mul_(std)


def _fill_units(view: torch.Tensor, lo: int, hi: int, total: int, *, seed: int, name: str,
                std: float, piece_elems: int) -> None:
    """Fill ``view`` (units [lo, hi) of ``total``, shape (hi-lo, R, C)) from its pieces."""
    _, rows, cols = view.shape
    numel = rows * cols
    if hi <= lo or numel == 0:
        return
    if numel <= piece_elems:  # a piece = b whole units; piece k = units [k*b, (k+1)*b)
        b = piece_elems // numel
        for k in range(lo // b, (hi - 1) // b + 1):
            p0, p1 = k * b, min((k + 1) * b, total)
            vals = _normal(piece_key(seed, name, f"b{k}"), (p1 - p0) * numel, std)
            vals = vals.view(p1 - p0, rows, cols)
            a0, a1 = max(lo, p0), min(hi, p1)
            view[a0 - lo:a1 - lo].copy_(vals[a0 - p0:a1 - p0])
        return
    step = max(1, piece_elems // cols)  # a piece = `step` rows of one unit
    for u in range(lo, hi):
        for k, r0 in enumerate(range(0, rows, step)):
            r1 = min(r0 + step, rows)
            vals = _normal(piece_key(seed, name, f"u{u}.r{k}"), (r1 - r0) * cols, std)
            view[u - lo, r0:r1].copy_(vals.view(r1 - r0, cols))


def init_param_(param: torch.Tensor, *, name: str, kind: str | None,
                units: tuple[int, int] | None, dims: ModelDims, seed: int, std: float,
                piece_elems: int = PIECE_ELEMS) -> None:
    """Fill a rank-local parameter in place with its units of the global init.

    ``kind``/``units``: the ``layout.units`` kind and the units [lo, hi) this rank holds;
    ``param`` must have ``local_shape(kind, dims, hi - lo)``. ``kind=None`` (replicated): the
    whole tensor, ``units`` None or (0, rows). ``std``: the model's base init std (megatron's
    ``init_method_std``); the per-name std comes from ``init_std``. Any dtype or device.
    """
    with torch.no_grad():
        p_std = init_std(name, dims, std)
        if p_std is None:
            param.fill_(constant_value(name, zero_centered_gamma=bool(
                getattr(dims, "layernorm_zero_centered_gamma", False))))
            return
        if kind is None:
            total = param.shape[0] if param.dim() else 1
            if units not in (None, (0, total)):
                raise ValueError(f"{name}: replicated parameter takes units=None, got {units}")
            lo, hi = 0, total
        else:
            if units is None:
                raise ValueError(f"{name}: sharded kind {kind!r} needs units=(lo, hi)")
            lo, hi = units
            total = num_units(dims, PARAM_KINDS[kind].space)
            if not 0 <= lo <= hi <= total:
                raise ValueError(f"{name}: units={units} outside [0, {total}]")
            expect = local_shape(kind, dims, hi - lo)
            if tuple(param.shape) != expect:
                raise ValueError(f"{name}: shape {tuple(param.shape)} != local {expect} "
                                 f"for units {units}")
        view = unit_view(kind, dims, param.reshape(-1) if param.dim() == 0 else param)
        _fill_units(view, lo, hi, total, seed=seed, name=normalize_name(name), std=p_std,
                    piece_elems=piece_elems)


def init_global(name: str, kind: str | None, dims: ModelDims, seed: int, std: float, *,
                shape: tuple[int, ...] | None = None,
                piece_elems: int = PIECE_ELEMS) -> torch.Tensor:
    """The global (TP1, megatron memory layout) fp32 tensor of parameter ``name``: the
    assembly of every rank's ``init_param_`` shard. ``shape`` is required for ``kind=None``."""
    if kind is None:
        if shape is None:
            raise ValueError(f"{name}: replicated parameter needs shape=")
        out = torch.empty(shape, dtype=torch.float32)
        units = None
    else:
        out = torch.empty(global_shape(kind, dims), dtype=torch.float32)
        units = (0, num_units(dims, PARAM_KINDS[kind].space))
    init_param_(out, name=name, kind=kind, units=units, dims=dims, seed=seed, std=std,
                piece_elems=piece_elems)
    return out
