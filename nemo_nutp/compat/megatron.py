"""Differences between the megatron-core versions this project supports (0.16.1 and 0.19.x).

Every difference lives here, feature-detected (what the object *is*), not version-compared;
each with one line naming what changed. Importing this module touches no process group.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron.core.transformer import ModuleSpec


def nutp_mlp_submodule(mlp: Any, *, cls: type, local_ffn: int, tp_group: Any) -> Any:
    """A GPT layer spec's ``mlp`` entry, rebuilt to construct ``cls`` (NUTPMLP) over
    ``local_ffn`` FFN columns.

    * 0.16: a ``ModuleSpec(module=MLP, submodules=..., params=...)``; ``TransformerLayer`` passes
      a TP group only to the exact ``MLP`` class, so the spec carries ``tp_group``.
    * 0.19: a ``functools.partial(MLP.as_mlp_submodule, submodules=...)`` that
      ``TransformerLayer`` calls with ``config``, ``pg_collection``, ``is_mtp_layer``, ``name``;
      the TP group then comes from the (explicit) ``pg_collection``.
    """
    if isinstance(mlp, ModuleSpec):
        return ModuleSpec(module=cls, submodules=mlp.submodules,
                          params={**mlp.params, "nutp_local_ffn": local_ffn,
                                  "tp_group": tp_group})
    if isinstance(mlp, functools.partial) and "submodules" in mlp.keywords:
        submodules = mlp.keywords["submodules"]

        def build(*, config: Any, pg_collection: Any, is_mtp_layer: bool = False,
                  name: str | None = None, **kwargs: Any) -> Any:
            del is_mtp_layer
            return cls(config, submodules, nutp_local_ffn=local_ffn, tp_group=pg_collection.tp,
                       **({"name": name} if name is not None else {}), **kwargs)

        build.nutp_cls, build.nutp_local_ffn = cls, local_ffn  # type: ignore[attr-defined]
        build.nutp_submodules = submodules  # type: ignore[attr-defined]
        return build
    raise TypeError(f"unsupported megatron-core MLP spec {type(mlp).__name__}: {mlp!r}")


def nutp_mlp_linear_fc2(mlp: Any, cls: Any) -> None:
    """Make an ``mlp`` entry of ``nutp_mlp_submodule`` build ``linear_fc2`` as ``cls`` (its
    ``MLPSubmodules``: the spec's in 0.16, the one the 0.19 builder closes over)."""
    submodules = mlp.submodules if isinstance(mlp, ModuleSpec) else mlp.nutp_submodules
    submodules.linear_fc2 = cls


def nutp_mlp_of(mlp: Any) -> tuple[type, int]:
    """(class, local FFN columns) of an ``mlp`` entry made by ``nutp_mlp_submodule``."""
    if isinstance(mlp, ModuleSpec):
        return mlp.module, int(mlp.params["nutp_local_ffn"])
    return mlp.nutp_cls, int(mlp.nutp_local_ffn)
