"""A Ray cluster of several nodes on this machine for the Ray runners' tests (Ray's own
``ray.cluster_utils.Cluster``, as Ray's tests use it): a head node with no CPUs, so that every
runner lands on a worker node, and three worker nodes of 2 CPUs, each with 2 of the custom
resource ``agents``. These tests run in ``.venv-verl``, which has Ray (``make test-verl``).

The cluster lives for the module that asks for it; each test connects to it (``ray_cluster``)
and disconnects at its end, so a test elsewhere that starts a Ray of its own finds none."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True}
    )
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=2, resources={"agents": 2})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def ray_cluster(cluster) -> Iterator[object]:
    """The module's cluster, this process connected to it for the test."""
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
