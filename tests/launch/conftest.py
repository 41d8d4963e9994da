"""The real Slurm test cluster (``tests/helpers/slurm_cluster.py``), started once per session and
only when a test asks for it. A machine without what it needs fails the test with one line
naming the missing piece; it is never skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.slurm_cluster import NODES, SlurmCluster, missing_prerequisite


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = missing_prerequisite()
    if missing is not None:
        pytest.fail(missing, pytrace=False)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        print(f"\nslurm test cluster: {len(NODES)} idle nodes in {cluster.start_s:.1f} s "
              f"({cluster.root})")
        yield cluster
    finally:
        cluster.stop()
