"""``parallel/comm.py`` without processes: which groups cross scale-up domains, the delay
arithmetic, the helper thread holding a completion back, the per-group timing, and the
O(replicas) encoding of the per-replica slowest GPU (``train/loop.py``)."""

from __future__ import annotations

import time

import pytest

from nemo_nutp.common.faults import Fault, Faults
from nemo_nutp.config import load_config
from nemo_nutp.config.derived import plan_request
from nemo_nutp.layout import SPACES, build_plan
from nemo_nutp.parallel.comm import Comm, Domains, LinkFault, delay_s, scale_out_rate
from nemo_nutp.train.loop import _rate_code, link_faults


class Done:
    """A work that is already complete (the real op took no time)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def test_domains_and_crossing() -> None:
    d = Domains(rank_to_gpu=(0, 1, 2, 3, 4, 5, 6), domain_size=4)  # GPU 7 failed
    assert [d.domain(r) for r in range(7)] == [0, 0, 0, 0, 1, 1, 1]
    assert not d.crosses([0, 1, 2, 3]) and not d.crosses([4, 5, 6]) and not d.crosses([2])
    assert d.crosses([0, 4]) and d.crosses([3, 6, 1])
    shifted = Domains(rank_to_gpu=(4, 5, 0, 1), domain_size=4)  # ranks keyed by their GPU
    assert not shifted.crosses([0, 1]) and shifted.crosses([1, 2])


def test_plan_groups_cross_as_expected() -> None:
    """Two TP4 replicas in two 4-GPU domains: TP groups stay inside, sync groups cross."""
    plan = build_plan(plan_request(load_config(["health.failed_gpus=[]",
                                                "parallel.tp_base=4"])))
    d = Domains(plan.rank_to_gpu, plan.request.cluster.domain_size)
    assert plan.tp_groups() and not any(d.crosses(g) for g in plan.tp_groups())
    sync = [g for space in SPACES for g in plan.sync_groups(0, space)
            if len(g) > 1]
    assert sync and all(d.crosses(g) for g in sync)


def test_delay_arithmetic() -> None:
    assert delay_s(2_000_000, 4.0) == pytest.approx(0.5)
    assert delay_s(2_000_000, 4.0, factor=4.0) == pytest.approx(2.0)
    assert delay_s(2_000_000, None) == 0.0 and delay_s(0, 1.0) == 0.0
    f = LinkFault(gpu=5, step=3, factor=4.0, until=6)
    assert [f.factor_at(5, s) for s in range(2, 7)] == [1.0, 4.0, 4.0, 4.0, 1.0]
    assert f.factor_at(4, 4) == 1.0 and LinkFault(5, 3, 2.0).factor_at(5, 10**6) == 2.0


def test_emulated_op_completes_late_and_is_timed() -> None:
    """Ops on a cross-domain pair complete bytes/rate after the link is free (queued behind
    each other), x the slow-link factor of a member's GPU; a pair inside a domain is not
    delayed; the timing gives back the emulated rate."""
    d = Domains(rank_to_gpu=(0, 1, 2, 3, 4, 5, 6, 7), domain_size=4)
    comm = Comm(d, rank=1, rate_mb_s=1.0)
    t0 = time.perf_counter()
    h1 = comm.track(Done(), ("p2p", 5), 50_000, True)  # 0.05 s
    h2 = comm.track(Done(), ("p2p", 5), 50_000, True)  # queued: done at 0.10 s
    assert not h1.is_completed()  # the real op is done, the emulated one is not
    h2.wait()
    assert h1.is_completed() and time.perf_counter() - t0 >= 0.1
    assert comm.track(Done(), ("p2p", 2), 10**9, False) is None  # same domain: no delay
    assert time.perf_counter() - t0 < 0.5
    stats = comm.take_step()
    rate, nbytes = scale_out_rate(stats)
    assert nbytes == 100_000 and rate == pytest.approx(1.0, rel=0.3)
    assert scale_out_rate(comm.take_step()) == (None, 0)  # zeroed

    comm.faults = (LinkFault(gpu=5, step=2, factor=4.0),)
    comm.begin_step(2)
    t0 = time.perf_counter()
    comm.track(Done(), ("p2p", 5), 25_000, False)  # 0.025 s x 4
    comm.track(Done(), ("p2p", 6), 25_000, False)  # GPU 6: not slowed
    assert 0.125 <= time.perf_counter() - t0 < 0.5
    per_pair = {s.nbytes: s.busy_s for s in comm.take_step().lanes if s.nbytes}
    assert per_pair[25_000] > 0  # both pairs timed on their own lanes
    assert comm.factor([1, 5]) == 4.0 and comm.factor([1, 6]) == 1.0
    comm.close()  # the helpers end; a later op starts a new one
    assert not comm.lanes and comm.track(Done(), ("p2p", 5), 1, False) is None


def test_one_nic_per_gpu_is_shared_by_its_groups() -> None:
    """Two cross-domain groups of one rank share its NIC: ops issued at once on both complete
    one after the other (2 x 0.05 s), and the rank's rate (the NIC's busy time, overlaps once)
    is the emulated one; a pair inside the domain stays free."""
    comm = Comm(Domains(tuple(range(8)), 4), rank=1, rate_mb_s=1.0)
    t0 = time.perf_counter()
    a = comm.track(Done(), ("p2p", 5), 50_000, True)
    b = comm.track(Done(), ("p2p", 6), 50_000, True)  # another group: queued on the same NIC
    a.wait()
    t_a = time.perf_counter() - t0
    b.wait()
    t_b = time.perf_counter() - t0
    assert 0.05 <= t_a < 0.09 and t_b >= 0.1, (t_a, t_b)
    traffic = comm.take_step()
    rate, nbytes = scale_out_rate(traffic)
    assert nbytes == 100_000 and rate == pytest.approx(1.0, rel=0.3)
    lanes = sorted(s.busy_s for s in traffic.lanes if s.nbytes)
    assert lanes[1] >= 0.095  # b's group was in flight while a's op held the NIC
    comm.close()


def test_failed_op_raises_in_the_waiter() -> None:
    class Broken(Done):
        def wait(self) -> bool:
            raise RuntimeError("peer gone")

    comm = Comm(Domains((0, 4), 4), rank=0, rate_mb_s=1.0)
    h = comm.track(Broken(), ("p2p", 1), 10, True)
    with pytest.raises(RuntimeError, match="peer gone"):
        h.wait()


def test_rate_code_orders_rate_then_gpu() -> None:
    codes = {(r, g): _rate_code(r, g) for r in (0.124, 0.5, 48_000.0) for g in (0, 5, 131_071)}
    order = sorted(codes, key=codes.__getitem__)
    assert order == sorted(codes)  # by rate, then GPU
    q, g = divmod(int(codes[(0.124, 5)]), 1 << 18)
    assert (q / 1000, g) == (0.124, 5)


def test_slow_link_fault_keyed_by_gpu() -> None:
    """The fault names a rank of the first world; it is kept as that rank's GPU."""
    plan = build_plan(plan_request(load_config(["parallel.tp_base=4"])))  # GPU 7 failed
    f = Fault("slow_link", rank=5, step=3, factor=4.0, until=9)
    (link,) = link_faults(Faults([f, Fault("slow", rank=0, factor=2.0)]), plan)
    assert link == LinkFault(gpu=plan.rank_to_gpu[5], step=3, factor=4.0, until=9)
    with pytest.raises(ValueError, match=r"recovery\.fault\.rank=9"):
        link_faults(Faults([Fault("slow_link", rank=9)]), plan)
    assert link_faults(None, plan) == ()


def test_config_keys() -> None:
    cfg = load_config(["cluster.emulated_scale_out_mb_s=2.5", "recovery.fault.kind=slow_link",
                       "recovery.fault.rank=5", "recovery.fault.step=3",
                       "recovery.fault.until=8", "recovery.fault.factor=4"])
    assert cfg.cluster.emulated_scale_out_mb_s == 2.5
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match=r"cluster\.emulated_scale_out_mb_s="):
            load_config([f"cluster.emulated_scale_out_mb_s={bad}"])
    with pytest.raises(ValueError, match=r"recovery\.fault\.until=3"):
        load_config(["recovery.fault.kind=slow_link", "recovery.fault.step=3",
                     "recovery.fault.until=3"])
    from nemo_nutp.common.faults import parse

    (f,) = parse("slow_link:rank=5:step=3:factor=4:until=8")
    assert (f.kind, f.rank, f.step, f.factor, f.until) == ("slow_link", 5, 3, 4.0, 8)
