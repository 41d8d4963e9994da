"""The change-point detector (``health/changepoint.py``): no false alarm under bounded noise,
bounded delay for a real slowdown, one line for bad settings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.health.changepoint import Cusum

NOISE = st.floats(min_value=1 / 1.3, max_value=1.3, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(base=st.floats(min_value=1e-3, max_value=1e3), warm=st.lists(NOISE, min_size=5,
       max_size=5), noise=st.lists(NOISE, min_size=1, max_size=400))
def test_bounded_noise_never_fires(base: float, warm: list[float], noise: list[float]) -> None:
    """Any order of samples within the tolerance around the median of the warm-up (a CPU hog's
    jitter, adversarially ordered) never fires: each adds at most 0."""
    d = Cusum()
    for w in warm:
        d.add(base * w)
    mu = d.mu
    assert mu is not None
    assert not any(d.add(mu * r) for r in noise)


@settings(max_examples=200, deadline=None)
@given(slowdown=st.floats(min_value=1.5, max_value=20.0),
       noise=st.lists(NOISE, min_size=5, max_size=5))
def test_a_sustained_slowdown_fires_within_its_bound(slowdown: float, noise: list[float]
                                                     ) -> None:
    d = Cusum()
    for r in noise:
        d.add(r)
    bound = d.delay_bound(slowdown)
    assert bound is not None
    mu = d.mu
    assert mu is not None
    fired = next(i for i in range(1, 100) if d.add(mu * slowdown))
    assert fired <= bound


def test_known_delays_and_reset() -> None:
    d = Cusum()
    assert d.delay_bound(4.0) == 1 and d.delay_bound(2.0) == 3 and d.delay_bound(1.2) is None
    for _ in range(5):
        d.add(1.0)
    assert [d.add(4.0)] == [True] and d.ratio(4.0) == 4.0
    d.reset()
    assert d.mu is None and not d.add(4.0)  # warm-up again: the new layout's normal


def test_bad_settings_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"tolerance=1\.0: must be > 1"):
        Cusum(tolerance=1.0)
    with pytest.raises(ValueError, match=r"sample=0\.0: must be > 0"):
        Cusum().add(0.0)
