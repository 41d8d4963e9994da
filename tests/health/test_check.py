"""The one failure check of a running world (``health/check.py``): its order (exits, blame,
hang, health), the hang polling period, and the ``cause`` it names. Pure: no processes."""

from __future__ import annotations

from nemo_nutp.health.check import HANG_POLL_S, FailureCheck
from nemo_nutp.health.decisions import Failure
from nemo_nutp.health.watch import ScaleUp

HUNG = Failure((1,), "hung")
BACK = ScaleUp((3,), 0.0, 10)


def test_order_exits_blame_hang_health() -> None:
    calls: list[str] = []

    def hang(now: float) -> Failure | None:
        calls.append("hang")
        return HUNG

    def health(now: float) -> ScaleUp | None:
        calls.append("health")
        return BACK

    check = FailureCheck(started=0.0)
    v = check.poll({0: 0, 1: 0}, now=0.0, hang=hang, health=health)
    assert v.done and v.failure is None and calls == []  # every rank ended: nothing else
    v = check.poll({0: -9, 1: 1}, now=0.0, hang=hang, health=health)
    assert (v.failure.ranks, v.cause) == ((0,), "exit") and calls == []  # type: ignore[union-attr]
    v = check.poll({0: None, 1: None}, now=0.0, hang=hang, health=health)
    assert (v.failure, v.cause, v.scale_up) == (HUNG, "hang", None) and calls == ["hang"]
    v = check.poll({0: None, 1: None}, now=0.1, hang=hang, health=health)  # hang not yet due
    assert (v.failure, v.cause, v.scale_up) == (None, None, BACK)
    assert calls == ["hang", "health"] and not v.done


def test_hang_polled_every_period() -> None:
    seen: list[float] = []

    def hang(now: float) -> None:
        seen.append(now)

    check = FailureCheck(started=10.0)
    for t in (9.0, 10.0, 10.2, 10.0 + HANG_POLL_S - 0.01, 10.0 + HANG_POLL_S, 11.2):
        v = check.poll({0: None}, now=t, hang=hang)
        assert v == type(v)()  # nothing found, no health poll given
    assert seen == [10.0, 10.0 + HANG_POLL_S, 11.2]
