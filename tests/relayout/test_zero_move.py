"""The distributed optimizer's live move (``relayout/zero_move.py``), its pure parts: the
transfer list every rank derives from the directory, and the posting order of its messages."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.relayout.move import MoveImpossible
from nemo_nutp.relayout.zero_move import _transfers, pair_order
from tests.helpers.pair_replay import mismatches

KEY = (0, "w")


def _cuts(n: int, parts: int, data: st.DataObject) -> list[tuple[int, int]]:
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), max_size=parts), label="cuts"))
    bounds = [0, *cuts, n]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 200), ranks=st.integers(1, 5), data=st.data())
def test_every_needed_element_comes_once_from_its_holder(n: int, ranks: int,
                                                         data: st.DataObject) -> None:
    """Offers partition the elements (each held once: a primary or a gone rank's copy), needs
    partition them in another way: every need is cut at the offers it meets, each element of
    it sent exactly once, by the rank that offered it."""
    offers = _cuts(n, 6, data)
    needs = _cuts(n, 6, data)
    owner = [data.draw(st.integers(0, ranks - 1)) for _ in offers]
    taker = [data.draw(st.integers(0, ranks - 1)) for _ in needs]
    dirs: list[tuple[list, list]] = [([], []) for _ in range(ranks)]
    for (a, b), r in zip(offers, owner, strict=True):
        dirs[r][0].append((KEY, a, b))
    for (a, b), r in zip(needs, taker, strict=True):
        dirs[r][1].append((KEY, a, b))
    got = [0] * n
    for src, dst, key, lo, hi, j, i in _transfers(dirs):
        assert key == KEY and lo < hi
        oa, ob = dirs[src][0][j][1:]
        na, nb = dirs[dst][1][i][1:]
        assert oa <= lo < hi <= ob and na <= lo < hi <= nb
        for x in range(lo, hi):
            got[x] += 1
    assert got == [1] * n


def test_an_element_nobody_holds_makes_the_move_impossible() -> None:
    dirs = [([(KEY, 0, 4)], [(KEY, 0, 10)]), ([(KEY, 6, 10)], [])]  # [4, 6) is gone
    with pytest.raises(MoveImpossible, match=r"held by no survivor \(8 of 10 elements\)"):
        _transfers(dirs)


@settings(max_examples=60, deadline=None)
@given(st.sets(st.tuples(st.integers(0, 5), st.integers(0, 5)).filter(lambda p: p[0] != p[1]),
               max_size=20))
def test_messages_are_posted_head_to_head(pairs: set[tuple[int, int]]) -> None:
    """Every rank posts its sends and receives in ``pair_order``: both sides of every pair post
    the same sequence (one's send against the other's receive), what NCCL needs."""
    ops: dict[int, list[tuple[int, str, int]]] = {}
    for me in range(6):
        mine = [p for p in pairs if me in p]
        ops[me] = [(d, "send", 1) if s == me else (s, "recv", 1)
                   for s, d in pair_order(mine, me)]
    assert mismatches(ops) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=8), st.integers(1, 40))
def test_a_pairs_spans_cut_into_bounded_messages(lengths: list[int], limit: int) -> None:
    """The spans of one pair, cut into messages of at most ``limit`` elements, in order, each
    element once (both ends cut alike: the same function over the same list)."""
    from nemo_nutp.relayout.zero_move import _chunks

    ts, at = [], 0
    for k, n in enumerate(lengths):
        ts.append((0, 1, KEY, at, at + n, k, k))
        at += n + 3  # spans need not touch
    parts = _chunks(ts, limit)
    assert all(0 < sum(hi - lo for lo, hi, _, _ in p) <= limit for p in parts)
    flat = [(x, j) for p in parts for lo, hi, j, _ in p for x in range(lo, hi)]
    assert flat == [(x, k) for k, t in enumerate(ts) for x in range(t[3], t[4])]


def test_what_a_rank_held_is_copied_and_only_the_rest_asked_for() -> None:
    """``_take_local``: wanted spans cut at what this rank held (primaries and copies, two
    fields each); the held parts copied with their values, the rest returned with its offset."""
    import torch

    from nemo_nutp.relayout.zero_move import _take_local

    old = {"p": [[torch.arange(10.0), -torch.arange(10.0)]],
           "b": [[100 + torch.arange(5.0), -100 - torch.arange(5.0)]]}
    new = {"p": [[torch.zeros(12), torch.zeros(12)]], "b": [[torch.zeros(3), torch.zeros(3)]]}
    held = [((KEY, 20, 30), ("p", 0, 0)), ((KEY, 40, 45), ("b", 0, 0))]
    wanted = [((KEY, 15, 27), ("p", 0, 0)), ((KEY, 43, 46), ("b", 0, 0))]
    rest, copied = _take_local(wanted, held, old, new)
    assert copied == 7 + 2
    assert rest == [((KEY, 15, 20), ("p", 0, 0)), ((KEY, 45, 46), ("b", 0, 2))]
    assert new["p"][0][0].tolist() == [0] * 5 + list(range(7))  # elements 20..26
    assert new["p"][0][1][5:].tolist() == [-x for x in range(7)]
    assert new["b"][0][0].tolist() == [103, 104, 0]  # elements 43, 44 of the copy
