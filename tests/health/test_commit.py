"""The live path's pure decisions (``health/commit.py``) and its unblock mechanism
(``live/backend.py``) without a training job."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_nutp.common.faults import parse
from nemo_nutp.config import load_config
from nemo_nutp.health.commit import Decision, Report, decide, live_blocker, renumber
from nemo_nutp.health.decisions import Failure
from nemo_nutp.live import backend


def test_decide_discards_a_step_nobody_committed() -> None:
    # killed before or inside the vote: survivors in compute or voting of step 5
    d = decide({0: Report(5, "compute"), 1: Report(5, "voting"), 2: Report(5, "voting")})
    assert d == Decision(4, ())


def test_decide_completes_a_step_somebody_committed() -> None:
    # the vote returned on rank 1 only (then the dead rank's peers lost it): 0 and 2 apply
    d = decide({0: Report(5, "voting"), 1: Report(5, "committed"), 2: Report(5, "voting")})
    assert d == Decision(5, (0, 2))


def test_decide_after_the_update() -> None:
    # blocked in the next step's collectives, or in the committed step's save
    d = decide({0: Report(6, "compute"), 1: Report(5, "committed"), 2: Report(6, "compute")})
    assert d == Decision(5, ())


def test_decide_at_a_boundary_relayout() -> None:
    """Grow back / straggler: every rank stopped after step 4's update: 4 is committed, nobody
    applies anything, the new world starts at 5."""
    assert decide({r: Report(4, "committed") for r in range(6)}) == Decision(4, ())


def test_decide_rejects_a_broken_invariant() -> None:
    with pytest.raises(RuntimeError, match="commit invariant broken"):
        decide({0: Report(5, "compute"), 1: Report(5, "committed")})  # 0 never voted
    with pytest.raises(RuntimeError, match="commit invariant broken"):
        decide({0: Report(3, "compute"), 1: Report(5, "committed")})
    with pytest.raises(ValueError, match="no survivor"):
        decide({})


@given(st.integers(0, 50), st.lists(st.sampled_from(["before", "voting", "voted", "after"]),
                                    min_size=1, max_size=12))
def test_decide_every_survivor_ends_at_the_committed_step(step: int, where: list[str]) -> None:
    """Simulate a world at step ``step``: the vote's result reached some ranks ("voted") or
    none; each survivor ends holding exactly the decided step, and that step is committed iff
    some survivor saw the vote return."""
    if "before" in where and ("voted" in where or "after" in where):
        where = ["voting" if w == "before" else w for w in where]  # all voted before a commit
    reports = {}
    for r, w in enumerate(where):
        reports[r] = {"before": Report(step, "compute"), "voting": Report(step, "voting"),
                      "voted": Report(step, "committed"),
                      "after": Report(step + 1, "compute")}[w]
    d = decide(reports)
    committed = any(w in ("voted", "after") for w in where)
    assert d.step == (step if committed else step - 1)
    for r, rep in reports.items():
        assert rep.holds + (1 if r in d.apply else 0) == d.step


def _job(*over: str) -> object:
    return load_config(["recovery.enabled=true", "checkpoint.interval=2", *over])


def test_live_blockers_name_their_reason() -> None:
    f = Failure((1,), "killed by signal 9")
    assert live_blocker(_job("recovery.mode=live"), f, survivors=6) is None
    assert live_blocker(_job(), f, survivors=6) == "recovery.mode is restart"
    why = live_blocker(_job("recovery.mode=live", "train.distributed_optimizer=true"), f,
                       survivors=6)
    assert why is not None and "train.distributed_optimizer" in why
    assert "recovery.live_redundancy=true" in why  # what would make it live
    zero = _job("recovery.mode=live", "train.distributed_optimizer=true",
                "recovery.live_redundancy=true")
    assert live_blocker(zero, f, survivors=6, replicas=2) is None
    one = live_blocker(zero, f, survivors=6, replicas=1)  # no other replica kept a copy
    assert one is not None and "one replica" in one
    assert live_blocker(_job("recovery.mode=live"), Failure((), "stalled"),
                        survivors=7) == "no rank blamed for the failure"
    bad = dataclasses.replace(f, bad_input=True)
    assert "bad input" in str(live_blocker(_job("recovery.mode=live"), bad, survivors=6))


def test_mode_is_validated() -> None:
    with pytest.raises(ValueError, match=r"recovery\.mode"):
        load_config(["recovery.mode=sometimes"])


def test_live_redundancy_is_validated_before_anything_runs(tmp_path: object) -> None:
    """``recovery.live_redundancy`` without the distributed optimizer, or with one replica:
    one line naming the field, exit 2, before any process (group)."""
    with pytest.raises(ValueError, match=r"^recovery\.live_redundancy=True: needs "
                       r"train\.distributed_optimizer=true"):
        load_config(["recovery.live_redundancy=true"])
    from nemo_nutp.launch.nutp_train import check_inputs
    from nemo_nutp.layout import build_plan

    cfg = load_config(["train.distributed_optimizer=true", "recovery.live_redundancy=true",
                       "nutp.replicas=[4]"])
    from nemo_nutp.config import plan_request

    with pytest.raises(ValueError, match=r"^recovery\.live_redundancy=true: the plan has 1 "
                       "replica"):
        check_inputs(cfg, build_plan(plan_request(cfg)))


def test_renumber_follows_gpus() -> None:
    assert renumber((0, 1, 2, 3), (2, 3, 0)) == {0: 2, 1: None, 2: 0, 3: 1}


def test_fault_spec() -> None:
    (f, g) = parse("kill:rank=3:step=4:phase=vote,hang:rank=0:phase=relayout:gen=2")
    assert (f.kind, f.rank, f.step, f.phase, f.gen) == ("kill", 3, 4, "vote", 0)
    assert (g.kind, g.phase, g.gen) == ("hang", "relayout", 2)
    with pytest.raises(ValueError, match="NUTP_FAULT"):
        parse("kill:rank=3:step=4:phase=lunch")


def test_abortable_wait_unblocks_a_blocked_collective() -> None:
    """A gloo collective that can never complete (its peer is alive but never joins) is left
    within a few slices of the abort flag; a completed one returns at once."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    backend.install()
    try:
        results: dict[str, float] = {}

        def peer() -> None:  # rank 1 of the group joins, then never enters the collective
            g = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
            results["peer"] = 1.0
            time.sleep(1.5)  # then its sockets close: the abandoned work ends
            del g

        th = threading.Thread(target=peer, daemon=True)
        th.start()
        g0 = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
        work = g0.allreduce([torch.ones(2)])
        threading.Timer(0.3, lambda: backend.FLAG.set("test")).start()
        t0 = time.monotonic()
        with pytest.raises(backend.Aborted):
            work.wait()
        took = time.monotonic() - t0
        assert 0.25 <= took < 0.3 + 5 * backend.SLICE_S + 0.5, took
    finally:
        backend.FLAG.clear()
        backend.uninstall()


def test_abortable_wait_unblocks_a_blocked_recv() -> None:
    """A gloo receive whose sender never sends is left on the flag too, without closing the
    pair (a timed-out p2p wait would: it is waited on a helper thread)."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    backend.install()
    try:
        def peer() -> None:
            g = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
            time.sleep(1.5)
            del g

        threading.Thread(target=peer, daemon=True).start()
        g0 = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
        work = g0.recv([torch.zeros(2)], 1, 0)
        assert not backend._sliceable(work)
        threading.Timer(0.3, lambda: backend.FLAG.set("test")).start()
        t0 = time.monotonic()
        with pytest.raises(backend.Aborted):
            work.wait()
        assert time.monotonic() - t0 < 0.3 + 5 * backend.SLICE_S + 0.5
    finally:
        backend.FLAG.clear()
        backend.uninstall()
