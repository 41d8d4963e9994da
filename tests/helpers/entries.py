"""A rank entry (``recovery.world.RankEntry``) that trains nothing: it records how it was
started, for the tests of what the node agents start (``tests/recovery/test_hosts.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def record_rank(out: str, rank: int, world: int, job: Any, plan: Any, port: int,
                env: dict[str, str], local: int | None = None) -> None:
    """Write ``out/rank<rank>.json``: the arguments an agent gave this rank; exit 0."""
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "world": world, "local": local, "rank_to_gpu": list(plan.rank_to_gpu),
        "marker": env.get("TEST_MARKER")}))


def record_join(out: str, slot: int, job: Any, old_plan: Any, gpu: int, gen: int,
                env: dict[str, str]) -> None:
    Path(out, f"join{slot}.json").write_text(json.dumps({"gpu": gpu, "gen": gen}))
