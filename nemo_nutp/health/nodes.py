"""Which host is which cluster node: GPU ids keyed by host name, not by Slurm's node id.

A GPU id is ``node index x GPUs per node + local GPU``. Slurm numbers the nodes of each job step
from 0 (``SLURM_NODEID``), so when a step runs on fewer nodes -- a node was lost and the next
attempt runs without it -- or a requeued job lands on other nodes, the same id would name a
different physical GPU, and a failed GPU's id would blame a healthy one.

The **node table** (``<output.dir>/recovery/nodes.json``) fixes the numbering per host: entry
``i`` is the host that is cluster node ``i``. ``place`` maps the hosts present now onto it:

* a host already in the table keeps its index;
* a host not in it (a replacement) takes the lowest index whose host is not present, and that
  index is reported ``replaced``: its GPUs are a new machine's, and failures recorded against
  the old one no longer apply;
* an index left without a present host is ``absent``: its GPUs count as failed this attempt
  (``node_gpus``), and come back when its host does.

The first placement (no table yet) is Slurm's order. The table only grows to
``cluster.num_gpus / cluster.gpus_per_node`` nodes; more hosts than that is an error naming
the field. Nothing here creates a process group; the file is written atomically.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..layout.serialize import write_json_atomic
from ..layout.specs import bad_value

FILE = "nodes.json"


@dataclass(frozen=True)
class Placement:
    """The hosts present now, placed on the node table."""

    table: tuple[str | None, ...]
    """Cluster node index -> host name (None: no host has held it yet)."""
    index: dict[str, int]
    """Present host -> its cluster node index."""
    absent: tuple[int, ...]
    """Indices without a present host (their GPUs are failed this attempt)."""
    replaced: tuple[int, ...]
    """Indices a new host took over from one that is gone (their old failures are void)."""


def place(table: Sequence[str | None] | None, present: Sequence[str], nodes: int) -> Placement:
    """Place ``present`` (hosts in Slurm's node order, each once) on ``table`` (None: the first
    placement) of a cluster of ``nodes`` nodes."""
    if len(set(present)) != len(present):
        dup = next(h for h in present if list(present).count(h) > 1)
        raise ValueError(f"host {dup!r} reported twice: each node needs its own name "
                         "(SLURMD_NODENAME)")
    if len(present) > nodes:
        raise bad_value("cluster.num_gpus", f"{nodes} nodes", f"the job runs on "
                        f"{len(present)} hosts ({', '.join(present)})")
    old: list[str | None] = list(table) if table is not None else []
    if len(old) > nodes:
        raise bad_value("cluster.num_gpus", f"{nodes} nodes",
                        f"smaller than the node table's {len(old)} ({FILE})")
    old += [None] * (nodes - len(old))
    new = list(old)
    index = {h: i for i, h in enumerate(old) if h is not None and h in present}
    free = [i for i, h in enumerate(old) if h is None or h not in present]
    replaced = []
    for h in present:
        if h not in index:
            i = free.pop(0)
            if old[i] is not None:
                replaced.append(i)
            new[i], index[h] = h, i
    absent = tuple(i for i in range(nodes) if new[i] is None or new[i] not in index)
    return Placement(tuple(new), index, absent, tuple(replaced))


def node_gpus(indices: Iterable[int], gpus_per_node: int) -> frozenset[int]:
    """Every GPU id of the nodes ``indices``."""
    return frozenset(i * gpus_per_node + g for i in indices for g in range(gpus_per_node))


def carry(table: Sequence[str | None] | None, failed: Iterable[int], hosts: Sequence[str],
          gpus_per_node: int) -> frozenset[int]:
    """A new allocation's failed GPUs in its own numbering (``hosts``: its nodes in Slurm's
    order, node ``k`` = ``hosts[k]``): each failed GPU of ``table``'s numbering moves with its
    host; a host not in the new allocation takes its failures with it (used by the live
    control process of a requeued job, whose agents are Slurm's node ids)."""
    if table is None:
        return frozenset()
    where = {h: k for k, h in enumerate(hosts)}
    out = set()
    for g in failed:
        i = g // gpus_per_node
        host = table[i] if i < len(table) else None
        if host is not None and host in where:
            out.add(where[host] * gpus_per_node + g % gpus_per_node)
    return frozenset(out)


def read_table(rdir: Path) -> list[str | None] | None:
    """The node table of ``rdir`` (a recovery directory), or None if there is none yet."""
    try:
        hosts = json.loads((rdir / FILE).read_text())["hosts"]
    except (OSError, ValueError, KeyError):
        return None
    return [None if h is None else str(h) for h in hosts]


def write_table(rdir: Path, placement: Placement) -> None:
    write_json_atomic({"hosts": list(placement.table)}, rdir / FILE)
