"""The control process's wait for a world being built names why it fell back: a rank that
found the state unmovable (``unmovable<gen>``, e.g. two adjacent members of a distributed
optimizer's redundancy ring lost) is not reported as a second failure."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_nutp.health.commit import UNMOVABLE
from nemo_nutp.recovery import control


class _Store:
    def __init__(self) -> None:
        self.kv: dict[str, str] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        return self.kv[key].encode()


def _world(codes: list[int | None], gen: int = 2) -> control.World:
    procs = [SimpleNamespace(exitcode=c) for c in codes]
    return control.World(None, None, procs, list(range(len(codes))), frozenset(), gen,
                         Path("."))


def test_unmovable_state_is_the_reason_not_a_second_failure() -> None:
    store = _Store()
    store.kv[f"{UNMOVABLE}2"] = json.dumps({"reason": "optimizer state of x [0, 4) is held by "
                                                      "no survivor", "slot": 1})
    with pytest.raises(control.Fallback, match="cannot move live: optimizer state of x"):
        control._wait_keys(store, ["started2"], _world([None, 3]), [0, 1], 5.0, "building")


def test_an_exit_without_a_reason_is_a_second_failure() -> None:
    store = _Store()
    store.kv[f"{UNMOVABLE}1"] = json.dumps({"reason": "an older world's", "slot": 0})
    with pytest.raises(control.Fallback, match="second failure during the re-layout: rank 1"):
        control._wait_keys(store, ["started2"], _world([None, 1]), [0, 1], 5.0, "building")


def test_the_wait_ends_when_the_keys_are_there() -> None:
    store = _Store()
    store.kv["started2"] = "{}"
    control._wait_keys(store, ["started2"], _world([None, None]), [0, 1], 5.0, "building")
