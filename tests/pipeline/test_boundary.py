"""Stage-boundary maps (``pipeline.boundary``): every receiver gets each of its rows exactly
once, from a sender that holds them; gradients go back to every sender's rows exactly once."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.pipeline.boundary import boundary_pieces, grad_pieces, rows


def _cover(pieces: list[tuple[int, int, int, int]], owner_deg: int, holder_deg: int,
           seq: int, sp: bool, *, to_index: int, from_index: int) -> None:
    for k in range(holder_deg):
        want = rows(holder_deg, k, seq, sp)
        got = sorted((p[2], p[3]) for p in pieces if p[to_index] == k)
        assert got and got[0][0] == want[0] and got[-1][1] == want[1], (k, got, want)
        assert all(a[1] == b[0] for a, b in pairwise(got)), got  # no gap, no overlap
    for p in pieces:  # the sender holds what it sends
        lo, hi = rows(owner_deg, p[from_index], seq, sp)
        assert lo <= p[2] < p[3] <= hi, (p, lo, hi)


@settings(max_examples=200, deadline=None)
@given(a=st.integers(1, 8), b=st.integers(1, 8), mult=st.integers(1, 6), sp=st.booleans())
def test_every_row_once_both_ways(a: int, b: int, mult: int, sp: bool) -> None:
    seq = a * b * mult
    fwd = boundary_pieces(a, b, seq, sp)
    _cover(fwd, a, b, seq, sp, to_index=1, from_index=0)
    bwd = grad_pieces(a, b, seq, sp)
    _cover(bwd, b, a, seq, sp, to_index=1, from_index=0)
    if sp:  # pieces, never the whole sequence to everyone: total rows moved = S per side
        assert sum(p[3] - p[2] for p in fwd) == seq
    else:  # one copy per receiver
        assert len(fwd) == b and len(bwd) == a


def test_sequence_parallel_moves_pieces_not_the_sequence() -> None:
    # 4 -> 2 under SP: receiver 0 takes rows 0..6 from senders 0 and 1, never rows 6..12.
    assert boundary_pieces(4, 2, 12, True) == [(0, 0, 0, 3), (1, 0, 3, 6), (2, 1, 6, 9),
                                               (3, 1, 9, 12)]
    assert grad_pieces(2, 3, 12, False) == [(0, 0, 0, 12), (1, 1, 0, 12)]


@settings(max_examples=25, deadline=None)
@given(first=st.integers(1, 4), last=st.integers(1, 4), other=st.integers(1, 4))
def test_tied_embedding_pairs_cover_every_vocab_row_once(first: int, last: int,
                                                         other: int) -> None:
    """``Plan.embedding_groups``: the pairs' vocab overlaps tile every replica's vocabulary."""
    from tests.helpers.parity import Case, make_plan

    plan = make_plan(Case("x", ((first, last), (other, other)), pp=2,
                          model=dict(tie_embeddings=True)))
    pairs = {tuple(p) for p in plan.embedding_groups()}
    vocab = plan.request.model.vocab_size
    for rep in plan.replicas:
        b0 = plan.unit_bounds(0, "vocab", rep.tp[0])
        bl = plan.unit_bounds(1, "vocab", rep.tp[1])
        spans = sorted((max(b0[j], bl[k]), min(b0[j + 1], bl[k + 1]))
                       for j in range(rep.tp[0]) for k in range(rep.tp[1])
                       if (rep.ranks[0][j], rep.ranks[1][k]) in pairs)
        assert spans[0][0] == 0 and spans[-1][1] == vocab
        assert all(lo < hi for lo, hi in spans)
        assert all(a[1] == b[0] for a, b in pairwise(spans)), spans
