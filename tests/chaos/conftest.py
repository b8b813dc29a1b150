"""Fixtures for the chaos scenarios: namespaced hosts plus jobs, torn down in that order."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.etcd_cluster import EtcdCluster
from tests.support.jobs import JobRunner
from tests.support.netns import Cluster, MissingTool, Unavailable


class Chaos:
    """What a scenario gets: `cluster(k)` builds hosts, `jobs` starts launchers."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.jobs = JobRunner(tmp)
        self.clusters: list[Cluster] = []

    def cluster(self, k: int) -> Cluster:
        c = Cluster(k)
        c.before_close.append(self.jobs.cleanup)  # also on atexit / SIGTERM
        self.clusters.append(c)
        try:
            c.start()
        except Unavailable as e:
            pytest.skip(f"network namespaces unavailable: {e}")
        except MissingTool as e:
            pytest.fail(str(e), pytrace=False)
        return c

    def require(self) -> None:
        """Skips the test where network namespaces cannot be made (not root)."""
        try:
            Cluster._probe()
        except Unavailable as e:
            pytest.skip(f"network namespaces unavailable: {e}")

    def close(self) -> None:
        try:
            self.jobs.cleanup()  # the launchers and every marked worker, remote ones too
        finally:
            errors = []
            for c in reversed(self.clusters):
                try:
                    c.close()  # then whatever is left in the namespaces, and the network
                except Exception as e:
                    errors.append(str(e))
            if errors:
                raise RuntimeError("; ".join(errors))


@pytest.fixture
def chaos(tmp_path: Path):
    c = Chaos(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def etcd_on_hosts(chaos):
    """A 3-member etcd cluster, one member in each of the 3 hosts' namespaces (as a job would
    run it on its own hosts): a host's processes killed take its member with them."""
    made: list[EtcdCluster] = []

    def start(c: Cluster) -> EtcdCluster:
        e = EtcdCluster(3, addresses=[h.addr for h in c.hosts], netns=[h.ns for h in c.hosts])
        made.append(e)
        return e.start()

    yield start
    for e in made:
        e.close()
