"""The slow-link watch's pure decisions (``health/links.py``): which pairs the probe times, how
they are scheduled, who a set of pair timings names slow, and when the watch asks for a probe."""

from __future__ import annotations

from nemo_nutp.health.links import (
    PROBE_MAX_BYTES,
    PROBE_MIN_BYTES,
    REPROBE_EVERY,
    LinkWatch,
    localise,
    probe_bytes,
    probe_pairs,
    probe_rounds,
)

GPUS = list(range(8))  # two 4-GPU domains
HEALTHY, SLOW = 0.3, 1.2  # seconds of a pair: healthy, one end 4x slow


def _times(pairs: list[tuple[int, int]], slow: set[int], *, compute: bool = False
           ) -> list[float]:
    """A pair is slow when one of its ends has a slow NIC (a slow compute GPU: never)."""
    return [HEALTHY if compute or not ({a, b} & slow) else SLOW for a, b in pairs]


def test_pairs_cross_domains_and_avoid_suspects() -> None:
    pairs = probe_pairs([5, 1], GPUS, 4)
    by = {s: [p for p in pairs if s in p] for s in (1, 5)}
    assert len(by[1]) == 2 and len(by[5]) == 2
    assert {1, 5} not in [set(p) for p in pairs]  # partners are never each other's reference
    for a, b in pairs:
        assert a // 4 != b // 4, pairs  # every pair crosses domains (Comm emulates it)
    ref = [p for p in pairs if not set(p) & {1, 5}]
    assert len(ref) == 1  # one reference pair of non-suspects
    peers = [b for s in (1, 5) for a, b in by[s]]
    assert len(set(peers)) == 4  # four different peers: none measured twice


def test_rounds_never_share_a_gpu() -> None:
    pairs = probe_pairs([1, 5], GPUS, 4)
    rounds = probe_rounds(pairs)
    assert sorted(i for r in rounds for i in r) == list(range(len(pairs)))
    for r in rounds:
        ends = [g for i in r for g in pairs[i]]
        assert len(ends) == len(set(ends)), (r, pairs)
    assert len(rounds) == 2


def test_localise_names_the_slow_end_of_a_pair() -> None:
    """GPU 5's NIC is slow; its sync partner GPU 1 read just as slow in the step metrics: the
    probe names 5 only, with the rate ratio of a 4x slowdown."""
    for slow in (5, 1):
        pairs = probe_pairs([1, 5], GPUS, 4)
        got = localise(pairs, _times(pairs, {slow}), [1, 5])
        assert got[slow] == (True, HEALTHY / SLOW)
        other = 6 - slow
        assert got[other] == (False, 1.0)


def test_localise_compute_straggler_and_noise_are_not_links() -> None:
    pairs = probe_pairs([1, 5], GPUS, 4)
    assert not any(s for s, _ in localise(pairs, _times(pairs, {5}, compute=True),
                                          [1, 5]).values())
    # a noisy host: any pair up to 1.9x slower than the fastest is never a slow NIC
    noisy = [HEALTHY * (1.0 + 0.9 * (i % 2)) for i in range(len(pairs))]
    assert not any(s for s, _ in localise(pairs, noisy, [1, 5]).values())
    # the whole fabric slow: no NIC to blame
    assert not any(s for s, _ in localise(pairs, [SLOW] * len(pairs), [1, 5]).values())


def test_localise_needs_every_pair_slow() -> None:
    """A suspect with one slow pair (its peer is the slow one) is not named."""
    pairs = [(5, 0), (5, 2), (3, 7)]
    assert localise(pairs, [SLOW, HEALTHY, HEALTHY], [5]) == {5: (False, 1.0)}
    assert localise(pairs, [SLOW, SLOW, HEALTHY], [5])[5][0]


def test_probe_bytes_clamped() -> None:
    assert probe_bytes(1_000) == PROBE_MIN_BYTES
    assert probe_bytes(10**9) == PROBE_MAX_BYTES
    assert probe_bytes(1_000_002) == 1_000_000


def _rates(gpu_a: int, rate_a: float, gpu_b: int, rate_b: float) -> list[dict[str, float]]:
    return [{"gpu": gpu_a, "min": rate_a, "max": 0.25},
            {"gpu": gpu_b, "min": rate_b, "max": 0.25}]


def _watch() -> LinkWatch:
    return LinkWatch({g: g // 4 for g in GPUS}, 2)


def test_watch_probes_a_slow_link_then_marks_and_reprobes() -> None:
    w = _watch()
    for step in range(5):  # warm-up
        assert w.observe(step, 1.0, _rates(1, 0.25, 5, 0.25)) == []
    # 4x slower link, the step 1.75x: both replicas' slowest GPUs are suspects at once
    assert sorted(w.observe(5, 1.75, _rates(1, 0.0625, 5, 0.0625))) == [1, 5]
    pairs = probe_pairs([1, 5], GPUS, 4)
    events = w.judge(6, [1, 5], pairs, _times(pairs, {5}))
    assert events == [{"event": "slow_link", "gpus": [5], "kind": "nic", "rate_ratio": 0.25,
                       "step": 6}]
    # the detectors restarted: the slow normal is learnt, no probe every step
    steps = range(6, 7 + 2 * REPROBE_EVERY)
    asks = [w.observe(s, 1.75, _rates(1, 0.0625, 5, 0.0625)) for s in steps]
    assert [s for s, a in zip(steps, asks, strict=True) if a] == [6 + REPROBE_EVERY,
                                                                 6 + 2 * REPROBE_EVERY]
    assert asks[REPROBE_EVERY] == [5]
    pairs = probe_pairs([5], GPUS, 4)
    assert w.judge(11, [5], pairs, _times(pairs, {5})) == []  # still slow: nothing new
    assert w.judge(15, [5], pairs, _times(pairs, set())) == [
        {"event": "link_recovered", "gpus": [5], "step": 15}]
    assert w.marked == {}


def test_watch_needs_the_step_to_slow_down() -> None:
    """A rate drop that does not slow the step (overlapped sync) does not probe; nor does a
    slower step whose rates hold (a compute straggler before its partners wait)."""
    w = _watch()
    for step in range(5):
        w.observe(step, 1.0, _rates(1, 0.25, 5, 0.25))
    assert w.observe(5, 1.0, _rates(1, 0.0625, 5, 0.0625)) == []
    assert w.observe(6, 3.0, _rates(1, 0.25, 5, 0.25)) == []


def test_watch_healthy_noise_never_probes() -> None:
    w = _watch()
    for step in range(200):
        j = 1.0 + 0.25 * ((step * 7919) % 3 - 1)  # within the 1.3x tolerance
        assert w.observe(step, 1.0 * j, _rates(1, 0.25 / j, 5, 0.25 * j)) == []
