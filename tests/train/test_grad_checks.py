"""megatron's gradient checks on the global grad norm (``train/step.py:GradChecks``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_nutp.train.step import GradChecks, StepOptions


def test_nan_and_inf_name_parameters() -> None:
    checks = GradChecks(StepOptions())
    for bad in (math.nan, math.inf):
        with pytest.raises(FloatingPointError, match=r"decoder\.x\.weight.*check_for_nan"):
            checks.check(bad, step=3, names=lambda: ["decoder.x.weight"])
    GradChecks(StepOptions(check_for_nan_in_grad=False)).check(math.nan, step=0, names=list)


def test_large_grad_only_after_a_full_window() -> None:
    checks = GradChecks(StepOptions(large_grad_factor=10.0, large_grad_window=3))
    checks.check(1.0, step=0, names=list)
    checks.check(50.0, step=1, names=list)  # history not full yet: no verdict
    checks.check(2.0, step=2, names=list)
    checks.check(400.0, step=3, names=list)  # 400 <= 10 x 50
    with pytest.raises(FloatingPointError, match=r"large_grad_factor=10\.0"):
        checks.check(4001.0, step=4, names=list)  # > 10 x max(50, 2, 400)


@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=40))
def test_off_never_raises(norms: list[float]) -> None:
    checks = GradChecks(StepOptions(large_grad_factor=0.0))
    for i, n in enumerate(norms):
        checks.check(n, step=i, names=list)
