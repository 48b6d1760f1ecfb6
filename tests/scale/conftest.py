"""Real Triton replicas (the `tiny` model) and real Envoy in front of them, on loopback ports.

- `replicas`: three started Triton servers, shared by the tests of this package and stopped after
  them; tests must not stop them (a test that kills or signals a replica starts its own with
  `start_replica`).
- `proxy`: an Envoy over those three, new for each test (a fraction of a second); `Envoy.update`
  changes its replicas live.
- `spare_replica`: a started Triton of a test's own, to kill or signal: one per test of the module
  that asks for one, all started together in the background from the module's first test on.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from bench.serving import stop_all
from serving.host.envoy import Replica, start_envoy
from tests.fixtures.triton import TEST_SETTINGS


@pytest.fixture(scope="session")
def tiny_repository(artifact_dir, tmp_path_factory) -> Path:
    from serving.triton.repository import write_repository

    return write_repository(artifact_dir("tiny"), tmp_path_factory.mktemp("tiny-repository"), TEST_SETTINGS)


@pytest.fixture(scope="package")
def start_replica(tiny_repository, tmp_path_factory):
    """`start_replica(**ports)` -> a started Triton on the tiny repository, stopped at the end."""
    from serving.host.launcher import start_triton

    started = []

    def start(**ports):
        log_path = tmp_path_factory.mktemp("replica") / "triton.log"
        server = start_triton(tiny_repository, log_path=log_path, **ports)
        started.append(server)
        return server

    yield start
    stop_all(started)


@pytest.fixture(scope="package")
def replicas(start_replica):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # at once: about half the wait of one after another
        return list(pool.map(lambda _: start_replica(), range(3)))


@pytest.fixture(scope="module")
def spare_replicas(request, replicas, start_replica):
    """Futures of the module's spare replicas (started after the shared ones), one per selected test
    of the module taking `spare_replica`; all of them have started (or failed) by the module's end."""
    wanted = sum(
        getattr(item, "module", None) is request.module and "spare_replica" in item.fixturenames
        for item in request.session.items
    )
    pool = concurrent.futures.ThreadPoolExecutor(max(wanted, 1))
    futures = [pool.submit(start_replica) for _ in range(wanted)]
    pool.shutdown(wait=False)
    yield futures
    concurrent.futures.wait(futures)  # none starts after `start_replica` has stopped the others


@pytest.fixture
def spare_replica(spare_replicas):
    """A started Triton of this test's own; the other spares have finished starting too, so that no
    start competes with the test for the CPU."""
    concurrent.futures.wait(spare_replicas)
    return spare_replicas.pop().result()


def replica_of(server, draining: bool = False) -> Replica:
    return Replica(server.host, server.ports["http"], server.ports["grpc"], draining=draining)


@pytest.fixture
def proxy(replicas):
    envoy = start_envoy([replica_of(server) for server in replicas])
    yield envoy
    envoy.stop()
