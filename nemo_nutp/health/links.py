"""Detect and localise a slow link (issue #36 item 2): the watch over the per-step metrics and
the active probe's pure decisions. No torch, no process group (the probe's transfers are
``train/links.py``'s).

**The watch** (``LinkWatch``, rank 0, O(replicas) per step). Input: what the per-step all-reduce
already gives every rank (``train/loop.gather_times``): the step's wall time and, per replica,
its slowest GPU and that GPU's scale-out rate. One ``Cusum`` on the step time and one per
replica on seconds per MB of its slowest GPU (1 / rate). A replica whose rate detector fires
while the step is slower than the step detector's tolerance names its slowest GPU a *suspect*.
Timing cannot say more: a GPU with a slow NIC and its sync partner share every cross-domain op,
so both read slow. A slow compute GPU makes its partners wait inside their ops, so their rate
drops too: only the probe tells the two apart.

**The probe** (FALCON's micro-benchmark step). Each suspect sends a fixed-size message to two
different peers in other scale-up domains (never another suspect when one can be avoided), and
one reference pair of non-suspects crosses domains too (``probe_pairs``); the pairs run in
rounds in which no GPU is in two pairs (``probe_rounds``). ``localise``: the reference rate is
the fastest pair's; a suspect is a slow NIC when *every* pair it is in runs at most
``1 / SLOW_RATIO`` of it: a slow NIC slows all its pairs, a healthy end of a slow pair is fast
with its other peer, and after a compute straggler every pair is healthy (no ``slow_link``).
When every pair is slow (the whole fabric), nothing is named (a "domain" verdict is not built).

**After a probe** the probed replicas' rate detectors and the step detector restart (a new
normal is learnt from the next ``warmup`` steps): the probe answered the alarm, so a persisting
slowdown (a marked link, a straggler the probe cleared) does not probe every step. A GPU found
slow is *marked*; every ``REPROBE_EVERY`` steps it is probed again (alone with its peers), and
when it is found healthy ``link_recovered`` is logged and the detectors restart again (the
healthy normal). Events (``recovery/events.jsonl``): ``slow_link`` (gpus, kind ``nic``,
rate_ratio: the GPU's best pair rate over the reference, step), ``link_recovered`` (gpus,
step), and ``link_probe`` for every probe (suspects, pairs, seconds, bytes, step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .changepoint import Cusum

SLOW_RATIO = 2.0
"""A pair is slow when its rate is at most the reference pair's over this (a 4x slow NIC reads
~4x; probe noise on a busy host stays well under 2x with the emulated network)."""
REPROBE_EVERY = 4
"""Steps between re-probes of a GPU marked slow (finds ``link_recovered``)."""
PROBE_MIN_BYTES = 64 * 1024
PROBE_MAX_BYTES = 4 * 1024 * 1024
"""A probe message is rank 0's cross-domain bytes of the step, clamped to these: about one
sync's traffic, a few MB at most, once per alarm."""
PROBE_REPEATS = 3
"""Parts a pair's message is sent in, one after the other; the fastest part is the pair's
time (a busy host only adds time)."""

Pair = tuple[int, int]
"""(sender GPU, receiver GPU)."""


def probe_bytes(step_bytes: int) -> int:
    """One probe message's size from rank 0's cross-domain bytes of a step (4-byte aligned)."""
    return min(max(int(step_bytes), PROBE_MIN_BYTES), PROBE_MAX_BYTES) // 4 * 4


def probe_pairs(suspects: Sequence[int], gpus: Sequence[int], domain_size: int
                ) -> list[Pair]:
    """Pairs that localise ``suspects`` among the job's ``gpus`` (domains: consecutive ranges
    of ``domain_size``): per suspect two peers in other domains, least used first and
    non-suspects first, then one reference pair of non-suspects in two domains (if any)."""
    dom = {g: g // domain_size for g in gpus}
    sus = sorted(set(suspects))
    uses = dict.fromkeys(gpus, 0)
    pairs: list[Pair] = []
    for s in sus:
        cands = sorted((g for g in gpus if dom[g] != dom[s]),
                       key=lambda g: (g in sus, uses[g], g))
        for peer in cands[:2]:
            pairs.append((s, peer))
            uses[s] += 1
            uses[peer] += 1
    healthy = sorted((g for g in gpus if g not in sus), key=lambda g: (uses[g], g))
    for i, a in enumerate(healthy):
        b = next((g for g in healthy[i + 1:] if dom[g] != dom[a]), None)
        if b is not None:
            pairs.append((a, b))
            break
    return pairs


def probe_rounds(pairs: Sequence[Pair]) -> list[list[int]]:
    """Indices of ``pairs`` in rounds where no GPU is in two pairs (greedy, in order): pairs
    of a round run at once, rounds one after the other, so no transfer shares an end."""
    rounds: list[list[int]] = []
    busy: list[set[int]] = []
    for i, (a, b) in enumerate(pairs):
        for r, used in zip(rounds, busy, strict=True):
            if a not in used and b not in used:
                r.append(i)
                used.update((a, b))
                break
        else:
            rounds.append([i])
            busy.append({a, b})
    return rounds


def localise(pairs: Sequence[Pair], seconds: Sequence[float], suspects: Sequence[int]
             ) -> dict[int, tuple[bool, float]]:
    """Per suspect that is in at least one pair: (slow NIC?, its best pair rate over the
    reference). Rates are relative (the bytes are the same for every pair): the reference is
    the fastest pair; a suspect is slow when every pair it is in is at most ``1 / SLOW_RATIO``
    of it."""
    assert len(pairs) == len(seconds)
    rates = [1.0 / max(s, 1e-9) for s in seconds]
    if not rates:
        return {}
    ref = max(rates)
    out: dict[int, tuple[bool, float]] = {}
    for s in sorted(set(suspects)):
        mine = [r for (a, b), r in zip(pairs, rates, strict=True) if s in (a, b)]
        if mine:
            ratio = max(mine) / ref
            out[s] = (ratio <= 1.0 / SLOW_RATIO, ratio)
    return out


HISTORY = 32
"""Step times the watch keeps (the healthy baseline of the mitigation ladder)."""
SETTLED_STEPS = 5
"""Steps after a mitigation whose median is its measured step time (``link_mitigation``)."""
MIN_GAIN = 0.05
"""A rung is taken only when it is predicted at least this much faster than doing nothing."""


@dataclass(frozen=True)
class Rung:
    """One rung of the mitigation ladder (issue #36 item 3, cheapest first): its predicted step
    seconds from the cost model (None: does not apply, ``note`` says why)."""

    action: str  # ignore | sync_relayout | resplit | exclude | restart | restore
    predicted_step_s: float | None
    note: str = ""
    applies: bool = True
    """Whether this release can take it live (``exclude`` and ``restart`` are predicted only)."""


def choose(rungs: Sequence[Rung], *, live: bool) -> tuple[Rung, str]:
    """The rung to take and why: the fastest predicted rung this run can apply (live mode),
    if it beats ``ignore`` by ``MIN_GAIN``; else ``ignore``."""
    base = next(r for r in rungs if r.action == "ignore")
    assert base.predicted_step_s is not None
    cands = [r for r in rungs if r.predicted_step_s is not None and r.action != "ignore"]
    if not cands:
        return base, "no rung applies"
    best = min(cands, key=lambda r: (r.predicted_step_s or 0.0))
    gain = 1.0 - (best.predicted_step_s or 0.0) / base.predicted_step_s
    if gain < MIN_GAIN:
        return base, f"the best rung ({best.action}) gains {gain:.1%} < {MIN_GAIN:.0%}"
    if not live:
        return base, (f"{best.action} is predicted {gain:.1%} faster, but re-layouts for a "
                      "link run live only (recovery.mode=live)")
    if not best.applies:
        ok = [r for r in cands if r.applies and r.predicted_step_s is not None
              and 1.0 - r.predicted_step_s / base.predicted_step_s >= MIN_GAIN]
        if not ok:
            return base, f"{best.action} is predicted best but is not applied live yet"
        best = min(ok, key=lambda r: (r.predicted_step_s or 0.0))
    gain = 1.0 - (best.predicted_step_s or 0.0) / base.predicted_step_s
    return best, f"predicted {gain:.1%} faster than doing nothing"


@dataclass
class Mitigation:
    """A mitigation taken: measured over the ``SETTLED_STEPS`` steps after ``step``."""

    action: str
    predicted_step_s: float
    healthy_step_s: float
    slowed_step_s: float
    step: int
    measured: list[float] = field(default_factory=list)


@dataclass
class LinkWatch:
    """Rank 0's detectors and marks (module docstring). ``replica_of``: each GPU's replica."""

    replica_of: Mapping[int, int]
    replicas: int
    step_detector: Cusum = field(default_factory=Cusum)
    rate_detectors: list[Cusum] = field(default_factory=list)
    marked: dict[int, int] = field(default_factory=dict)
    """GPU found slow -> the step of its ``slow_link``."""
    ratios: dict[int, float] = field(default_factory=dict)
    """GPU found slow -> its measured rate over the reference pair's."""
    history: list[tuple[int, float, float | None]] = field(default_factory=list)
    """The last ``HISTORY`` steps: (step, seconds, fastest GPU's scale-out MB/s or None)."""
    mitigation: Mitigation | None = None

    def carry(self, replica_of: Mapping[int, int], replicas: int) -> LinkWatch:
        """This watch's marks, history and mitigation in a new world (fresh detectors: the
        step time changed with the layout)."""
        return LinkWatch(replica_of, replicas, marked=dict(self.marked),
                         ratios=dict(self.ratios), history=list(self.history),
                         mitigation=self.mitigation)

    def healthy_step_s(self, before: int) -> float:
        """Median step time of the kept steps before ``before`` (excluding the first kept
        step: start-up), or of all kept steps when none is older."""
        xs = [t for s, t, _ in self.history if s < before]
        xs = xs[1:] if len(xs) > 2 else xs
        xs = xs or [t for _, t, _ in self.history]
        return float(sorted(xs)[len(xs) // 2])

    def healthy_rate(self, before: int) -> float | None:
        xs = sorted(r for s, _, r in self.history if s < before and r is not None)
        return float(xs[len(xs) // 2]) if xs else None

    def settle(self, step: int, step_s: float) -> dict[str, Any] | None:
        """A step after a mitigation: its ``link_mitigation`` event once ``SETTLED_STEPS``
        steps are measured (then None again)."""
        m = self.mitigation
        if m is None or step <= m.step:
            return None
        m.measured.append(step_s)
        if len(m.measured) < SETTLED_STEPS:
            return None
        self.mitigation = None
        xs = sorted(m.measured)
        return {"event": "link_mitigation", "action": m.action,
                "predicted_step_s": round(m.predicted_step_s, 4),
                "measured_step_s": round(xs[len(xs) // 2], 4),
                "healthy_step_s": round(m.healthy_step_s, 4),
                "slowed_step_s": round(m.slowed_step_s, 4), "step": step}

    def __post_init__(self) -> None:
        if not self.rate_detectors:
            self.rate_detectors = [Cusum() for _ in range(self.replicas)]

    def observe(self, step: int, step_s: float, rates: Sequence[Mapping[str, Any] | None]
                ) -> list[int]:
        """Judge one step (``gather_times``' step seconds and per-replica rates); the GPUs to
        probe at the next boundary (suspects and due re-probes; empty: none)."""
        fastest = max((float(r["max"]) for r in rates if r is not None), default=None)
        self.history = [*self.history, (step, step_s, fastest)][-HISTORY:]
        self.step_detector.add(max(step_s, 1e-9))
        slowed = self.step_detector.ratio(step_s) > self.step_detector.tolerance
        out: list[int] = []
        for r, rate in enumerate(rates):
            if rate is None:
                continue
            fired = self.rate_detectors[r].add(1.0 / max(float(rate["min"]), 1e-3))
            if fired and slowed and rate["gpu"] not in self.marked:
                out.append(int(rate["gpu"]))
        out += [g for g, since in self.marked.items()
                if step > since and (step - since) % REPROBE_EVERY == 0 and g not in out]
        return out

    def judge(self, step: int, suspects: Sequence[int], pairs: Sequence[Pair],
              seconds: Sequence[float]) -> list[dict[str, Any]]:
        """A probe's verdict: the events to log (``slow_link`` for a newly slow suspect,
        ``link_recovered`` for a marked one found healthy); the detectors restart."""
        events: list[dict[str, Any]] = []
        for gpu, (slow, ratio) in localise(pairs, seconds, suspects).items():
            if slow and gpu not in self.marked:
                self.marked[gpu] = step
                self.ratios[gpu] = ratio
                events.append({"event": "slow_link", "gpus": [gpu], "kind": "nic",
                               "rate_ratio": round(ratio, 4), "step": step})
            elif not slow and gpu in self.marked:
                del self.marked[gpu]
                self.ratios.pop(gpu, None)
                events.append({"event": "link_recovered", "gpus": [gpu], "step": step})
        if any(e["event"] == "link_recovered" for e in events):
            restart = list(self.rate_detectors)
        else:  # an alarm's probe (a re-probe of a marked GPU alone restarts nothing)
            restart = [self.rate_detectors[self.replica_of[g]] for g in suspects
                       if g in self.replica_of and self.marked.get(g, -1) in (-1, step)]
        if restart:
            self.step_detector.reset()
        for d in restart:
            d.reset()
        return events
