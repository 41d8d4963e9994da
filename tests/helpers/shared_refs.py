"""Stock references computed once per test session (one pytest process), shared by the test
files that check against the same one: CI runs each leg's files in one pytest process, so the
Qwen3-MoE reference that ``test_moe_parity``, ``test_moe_zero`` and ``test_moe_live`` compare
against is one stock run, and Bridge's stock run of the shrunk Qwen3-MoE recipe serves
``test_bridge_moe`` and ``test_bridge_moe_zero``.

A reference is keyed by everything that makes it (the case's ``repr``: model, routing, batch,
steps, seed; the Bridge worker and its overrides), so only identical runs are shared; a file
run alone computes its own. The files live in pytest's session temporary directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_MOE: dict[str, Path] = {}
_BRIDGE: dict[tuple[str, str, tuple[str, ...]], Path] = {}


def moe_references(cases: Sequence[Any], tmp_path_factory: Any) -> dict[str, Path]:
    """``moe_reference.moe_reference_worker``'s file of each ``MoECase`` by name
    (``moe_ref_<name>.pt``): the ones this session has not run yet are run, in one process."""
    from .dist import spawn
    from .moe_reference import moe_reference_worker

    missing = [c for c in cases if repr(c) not in _MOE]
    if missing:
        out = tmp_path_factory.mktemp("moe_ref_shared")
        spawn(moe_reference_worker, 1, (missing,), out)
        for c in missing:
            path = out / f"moe_ref_{c.name}.pt"
            if not path.exists():
                raise FileNotFoundError(path)
            _MOE[repr(c)] = path
    return {c.name: _MOE[repr(c)] for c in cases}


def moe_reference(case: Any, tmp_path_factory: Any) -> Path:
    """The reference file of one ``MoECase`` (``moe_references``)."""
    return moe_references([case], tmp_path_factory)[case.name]


def bridge_stock(worker: Callable[..., None], overrides: list[str], tmp_path_factory: Any,
                 outdir: Path) -> None:
    """Bridge's stock one-process run ``spawn(worker, 1, (overrides,), ...)`` once per session
    for the same worker and overrides; its files (``stock_rank0.json``, the routing maps, the
    expert biases, ...) copied into ``outdir``, where the NUTP workers read them."""
    from .bridge_fork import spawn_bridge

    key = (worker.__module__, worker.__qualname__, tuple(overrides))
    if key not in _BRIDGE:
        out = tmp_path_factory.mktemp("bridge_stock_shared")
        spawn_bridge(worker, 1, (overrides,), out)
        if not (out / "stock_rank0.json").exists():
            raise FileNotFoundError(out / "stock_rank0.json")
        _BRIDGE[key] = out
    shutil.copytree(_BRIDGE[key], outdir, dirs_exist_ok=True)
