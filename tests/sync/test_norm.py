"""The grad norm's fused kernels (``sync/norm.py``, issue #22 finding 11) give the per-piece
kernel's values: pure, one process, no process group."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_nutp.sync import norm


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=12), st.integers(0, 2 ** 31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(100, 20000))
def test_sumsqs_equals_the_per_piece_kernel(sizes: list[int], seed: int, dtype: torch.dtype,
                                             run: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(sum(sizes), generator=gen).to(dtype)
    pieces = torch.split(buf, sizes)
    saved = norm.SQUARES_ELEMENTS
    norm.SQUARES_ELEMENTS = run  # several runs of squares per list, or one
    try:
        got = norm.sumsqs(pieces)
    finally:
        norm.SQUARES_ELEMENTS = saved
    want = torch.stack([norm.sumsq(p) for p in pieces])
    assert got.dtype == torch.float64
    # the same fp32 squares, summed in fp64 in another order: within fp64 rounding
    assert torch.allclose(got, want, rtol=1e-14, atol=0), ((got - want) / want).abs().max()
    assert torch.equal(norm.sumsqs(pieces), got)  # deterministic


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=20))
def test_slots_add_repeated_slots_in_order(slots: list[int]) -> None:
    vals = torch.tensor([0.1 * (i + 1) for i in range(len(slots))], dtype=torch.float64)
    dst = torch.zeros(6, dtype=torch.float64)
    where = norm.Slots(list(enumerate(slots)))
    where.add(dst, vals)
    want = torch.zeros(6, dtype=torch.float64)
    for i, s in enumerate(slots):  # the per-piece loop: one add per piece, in order
        want[s] += vals[i]
    assert torch.equal(dst, want)
    assert len(where.passes) == max(slots.count(s) for s in set(slots))  # unique per pass
    where.add(dst, vals)  # the index tensors are reused on the next step
    for i, s in enumerate(slots):
        want[s] += vals[i]
    assert torch.equal(dst, want)
