"""The node table (``health/nodes.py``): GPU ids keyed by host name across attempts."""

from __future__ import annotations

import pytest

from nemo_nutp.health import nodes


def test_first_placement_is_slurms_order_and_hosts_keep_their_index() -> None:
    p = nodes.place(None, ["a", "b", "c"], 3)
    assert p.table == ("a", "b", "c") and p.absent == () and p.replaced == ()
    q = nodes.place(p.table, ["c", "a"], 3)  # b lost: Slurm numbers c node 1 now
    assert q.index == {"a": 0, "c": 2} and q.absent == (1,) and q.table == p.table
    assert nodes.node_gpus(q.absent, 4) == frozenset({4, 5, 6, 7})


def test_a_new_host_takes_the_lowest_free_index_and_voids_it() -> None:
    q = nodes.place(["a", "b", "c"], ["d", "c"], 3)
    assert q.index == {"c": 2, "d": 0} and q.replaced == (0,) and q.absent == (1,)
    assert q.table == ("d", "b", "c")
    r = nodes.place(None, ["a"], 2)  # fewer hosts than nodes from the start
    assert r.table == ("a", None) and r.absent == (1,)
    s = nodes.place(r.table, ["a", "e"], 2)
    assert s.replaced == () and s.absent == ()  # index 1 had no host: nothing to void


def test_bad_host_sets_are_one_line() -> None:
    with pytest.raises(ValueError, match="host 'a' reported twice"):
        nodes.place(None, ["a", "a"], 2)
    with pytest.raises(ValueError, match=r"cluster.num_gpus.*runs on 3 hosts"):
        nodes.place(None, ["a", "b", "c"], 2)


def test_table_file_round_trip(tmp_path) -> None:
    assert nodes.read_table(tmp_path) is None
    nodes.write_table(tmp_path, nodes.place(None, ["a"], 2))
    assert nodes.read_table(tmp_path) == ["a", None]


def test_carry_moves_failures_with_their_hosts() -> None:
    """A requeued live job (its agents are Slurm's node ids): GPU 7 of the old n2 (node 1) is
    GPU 3 when n2 is node 0 of the new allocation; n1's failure leaves with n1."""
    assert nodes.carry(["n1", "n2"], [2, 7], ["n2", "n3"], 4) == frozenset({3})
    assert nodes.carry(None, [2], ["n1"], 4) == frozenset()
