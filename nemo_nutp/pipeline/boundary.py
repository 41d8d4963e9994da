"""Who sends which rows of an activation across a pipeline-stage boundary (pure, no torch).

Stage ``s`` of a replica runs at degree ``a``, stage ``s + 1`` at degree ``b``; the activation
between them is ``[S, B, H]``. Without sequence parallelism every TP rank of a stage holds the
whole ``[S, B, H]`` (and, in backward, the whole gradient of it — column-parallel backward
all-reduces it over the TP group), so one copy is enough: receiver ``k`` takes the activation
from sender ``k mod a``, and sender ``j`` takes the gradient from receiver ``j mod b``. With
sequence parallelism rank ``j`` of a degree-``t`` stage holds rows ``[j S/t, (j+1) S/t)``:
each receiver takes exactly the rows it holds from the senders that hold them (a piece, never
the whole sequence), and gradients go back the same way.

``boundary_pieces(a, b, S, sp)`` lists the forward pieces ``(j, k, lo, hi)``: sender ``j``
sends global rows ``[lo, hi)`` to receiver ``k``; ``grad_pieces`` the backward ones
``(k, j, lo, hi)``: receiver ``k`` sends the gradient of rows ``[lo, hi)`` to sender ``j``.
Every receiver's rows are covered exactly once (property-tested).

With virtual pipeline stages (megatron's interleaved schedule) the stages form a ring: the last
stage's chunk ``c`` feeds the first stage's chunk ``c + 1``, so stage ``pp - 1`` (degree
``tp[pp-1]``) and stage 0 (degree ``tp[0]``) have a boundary too, mapped the same way
(``stage_links(..., ring=True)``).
"""

from __future__ import annotations

Piece = tuple[int, int, int, int]  # (from, to, lo, hi): global sequence rows [lo, hi)


def rows(t: int, j: int, seq: int, sp: bool) -> tuple[int, int]:
    """Sequence rows rank ``j`` of a degree-``t`` stage holds."""
    if not sp or t == 1:
        return 0, seq
    if seq % t:
        raise ValueError(f"model.seq_length={seq}: must be divisible by the degree {t} under "
                         "sequence parallelism")
    n = seq // t
    return j * n, (j + 1) * n


def _overlaps(src: int, dst: int, seq: int) -> list[Piece]:
    out = []
    for j in range(src):
        a0, a1 = rows(src, j, seq, True)
        for k in range(dst):
            b0, b1 = rows(dst, k, seq, True)
            lo, hi = max(a0, b0), min(a1, b1)
            if hi > lo:
                out.append((j, k, lo, hi))
    return out


def boundary_pieces(a: int, b: int, seq: int, sp: bool) -> list[Piece]:
    """Forward: (sender j of the degree-a stage, receiver k of the degree-b stage, rows)."""
    if not sp:
        return [(k % a, k, 0, seq) for k in range(b)]
    return _overlaps(a, b, seq)


def grad_pieces(a: int, b: int, seq: int, sp: bool) -> list[Piece]:
    """Backward: (receiver k of the degree-b stage, sender j of the degree-a stage, rows)."""
    if not sp:
        return [(j % b, j, 0, seq) for j in range(a)]
    return [(k, j, lo, hi) for j, k, lo, hi in _overlaps(a, b, seq)]


Link = tuple[int, int, int]  # (TP index of the peer in its stage, global row lo, hi)


def stage_links(tp: tuple[int, ...], s: int, j: int, seq: int, sp: bool, *, ring: bool
                ) -> dict[str, list[Link]]:
    """Rank ``j`` of stage ``s`` of a replica with per-stage degrees ``tp``: its
    ``send_next`` (activation rows to stage ``s + 1``), ``recv_next`` (their gradient back),
    ``send_prev`` (gradient rows to stage ``s - 1``) and ``recv_prev`` (activation rows from
    it), as (peer TP index, global rows). ``ring``: stage ``pp - 1``'s next is stage 0 and
    stage 0's prev is stage ``pp - 1`` (virtual pipeline stages); otherwise the first stage has
    no prev and the last no next."""
    pp = len(tp)
    out: dict[str, list[Link]] = {"send_next": [], "recv_next": [], "send_prev": [],
                                  "recv_prev": []}
    if ring or s + 1 < pp:
        a, b = tp[s], tp[(s + 1) % pp]
        out["send_next"] = [(k, lo, hi) for f, k, lo, hi in boundary_pieces(a, b, seq, sp)
                            if f == j]
        out["recv_next"] = [(k, lo, hi) for k, t, lo, hi in grad_pieces(a, b, seq, sp)
                            if t == j]
    if ring or s > 0:
        a, b = tp[(s - 1) % pp], tp[s]
        out["recv_prev"] = [(f, lo, hi) for f, k, lo, hi in boundary_pieces(a, b, seq, sp)
                            if k == j]
        out["send_prev"] = [(t, lo, hi) for k, t, lo, hi in grad_pieces(a, b, seq, sp)
                            if k == j]
    return out
