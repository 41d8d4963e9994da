"""``checkpoint.interval=auto`` (issue 25 item 3): Young/Daly from injected save costs and rates,
clamped; the config key takes an int or ``auto``; the failure rate's default is the simulator's."""

from __future__ import annotations

import math

import pytest

from nemo_nutp.checkpoint.interval import AutoInterval, interval_steps, mtbf_s, young_daly_s


def _expected_waste(tau: float, stall: float, mtbf: float) -> float:
    """Fraction of time lost with saves every ``tau`` s of work: the stall per interval plus,
    per failure (rate 1/M), half an interval of work and a stall recomputed (first order)."""
    return stall / (tau + stall) + (tau + stall) / (2 * mtbf)


@pytest.mark.parametrize("stall,mtbf", [(2.0, 3600.0), (30.0, 86400.0 / 8), (0.05, 1e6)])
def test_young_daly_minimises_the_first_order_waste(stall: float, mtbf: float) -> None:
    tau = young_daly_s(stall, mtbf)
    grid = [tau * (0.5 + k / 1000) for k in range(1001)]  # 0.5x .. 1.5x
    best = min(grid, key=lambda t: _expected_waste(t, stall, mtbf))
    assert abs(best - tau) <= 0.01 * tau, (best, tau)
    assert math.isclose(tau + stall, math.sqrt(2 * stall * mtbf))  # Young's interval


def test_interval_from_injected_costs_and_rates_is_clamped() -> None:
    rate, gpus = 0.01, 96  # failures per GPU-day, job size
    m = mtbf_s(rate, gpus)
    assert m == pytest.approx(86400 / 0.96)
    stall, step = 4.0, 0.5
    want = round((math.sqrt(2 * stall * m) - stall) / step)
    assert interval_steps(stall, step, rate, gpus, 1, 10**6) == want
    assert interval_steps(stall, step, rate, gpus, 1, 100) == 100  # clamped above
    assert interval_steps(stall, step, rate, gpus, want + 5, 10**6) == want + 5  # below
    # twice the GPUs: MTBF halves, the interval shrinks by ~sqrt(2)
    assert interval_steps(stall, step, rate, 2 * gpus, 1, 10**6) < want
    assert interval_steps(stall, step, 0.0, gpus, 1, 77) == 77  # no failures: the maximum


def test_auto_interval_starts_at_the_minimum_and_rederives_after_saves() -> None:
    a = AutoInterval(rate_per_gpu_day=0.5, gpus=8, lo=2, hi=500)
    assert a.steps == 2 and "until a save is measured" in a.start_line()
    changed = a.observe(stall_s=1.0, step_s=0.2)
    m = 86400 / 4.0
    assert changed and a.steps == min(500, round((math.sqrt(2 * m) - 1.0) / 0.2))
    a.observe(stall_s=100.0, step_s=0.2)
    a.observe(stall_s=1.0, step_s=0.2)  # the median stall (1.0) decides, not an outlier
    assert a.steps == min(500, round((math.sqrt(2 * m) - 1.0) / 0.2))
    assert "stall 1 s" in a.line() and "[2, 500]" in a.line()


def test_config_interval_takes_an_int_or_auto() -> None:
    from nemo_nutp.config import load_config
    from nemo_nutp.goodput.config import FailureConfig

    cfg = load_config(["checkpoint.interval=auto"])
    assert cfg.checkpoint.interval == "auto" and cfg.checkpoint.saves
    assert cfg.checkpoint_dir is not None
    assert load_config(["checkpoint.interval=3"]).checkpoint.interval == 3
    assert not load_config([]).checkpoint.saves
    assert load_config([]).recovery.rate_per_gpu_day == FailureConfig().rate_per_gpu_day
    for bad, key in (("checkpoint.interval=sometimes", "checkpoint.interval"),
                     ("checkpoint.interval=-1", "checkpoint.interval"),
                     ("checkpoint.interval_min=0", "checkpoint.interval_min")):
        with pytest.raises(ValueError, match=key):
            load_config([bad])
