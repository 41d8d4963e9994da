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


class _Dying(SimpleNamespace):
    """A process that exits (``code``) at the ``after``-th look at its exit code."""

    def __init__(self, code: int | None = None, after: int = 0) -> None:
        super().__init__(code=code, after=after, looks=0)

    @property
    def exitcode(self) -> int | None:
        self.looks += 1
        return self.code if self.code is not None and self.looks > self.after else None


def test_ranks_that_die_while_a_failure_is_handled_join_it() -> None:
    """Issue 35: the poll that found rank 1 killed saw ranks 2 and 3 alive; they die before
    reporting (2) and after their report (3). One failure of three ranks, in words, never a
    second failure; the survivors' reports are what the decision reads."""
    store = _Store()
    for slot in (0, 3, 4):
        store.kv[f"report1/{slot}"] = json.dumps({"step": 2, "phase": "forward", "out_at": 0.0})
    procs = [_Dying(), _Dying(-9), _Dying(-9, after=1), _Dying(-9, after=0), _Dying()]
    w = control.World(None, None, procs, [0, 1, 2, 3, 4], frozenset(), 1, Path("."))
    failure = control.Failure((1,), "killed by signal 9 (SIGKILL)")
    folded, posts = control._reports(store, w, failure)
    assert folded.ranks == (1, 2, 3) and sorted(posts) == [0, 4]
    assert folded.reason == ("killed by signal 9 (SIGKILL); while handling it, ranks 2, 3: "
                             "killed by signal 9 (SIGKILL)"), folded.reason
    # without the fold (the old wait): rank 2's exit was a second failure
    procs[2] = _Dying(-9, after=0)
    with pytest.raises(control.Fallback, match="second failure"):
        control._wait_keys(store, ["report1/2"], w, [0, 2, 4], 5.0, "waiting for reports")


def test_no_survivor_left_falls_back() -> None:
    w = control.World(None, None, [_Dying(-9), _Dying(-9)], [0, 1], frozenset(), 0, Path("."))
    with pytest.raises(control.Fallback, match="no survivor left"):
        control._reports(_Store(), w, control.Failure((0,), "x"))
