"""Every backend keeps the contract of runner/_backends/api.py (tests/_backend_contract.py); the Spark Connect
backend's run is in tests/runner/backends/test_spark_connect.py, on its real server. ``registry.backend_for`` makes the choice."""

from __future__ import annotations

import pytest
from _backend_contract import check_backend

from sparkhvd.runner._backends import connect, local, registry, spark
from sparkhvd.runner._backends.api import Backend
from sparkhvd.runner._runner_config import RunnerConfig


@pytest.mark.unit
def test_every_backend_implements_the_whole_contract():
    backends = [local.LocalBackend, spark.SparkBackend, connect.ConnectBackend]
    assert {b.name for b in backends} == {"local", "spark", "connect"}
    for backend in backends:
        assert issubclass(backend, Backend) and not backend.__abstractmethods__, backend


@pytest.mark.unit
def test_the_local_backend_keeps_the_contract():
    assert check_backend(registry.backend_for(RunnerConfig(np=-2)), 2) == {
        "name": "local", "bind_host": "127.0.0.1", "description": "2 processes on the driver", "free": 0}


def test_the_spark_backend_keeps_the_contract(spark):
    backend = registry.backend_for(RunnerConfig(np=2))
    assert check_backend(backend, 2) == {
        "name": "spark", "bind_host": "127.0.0.1", "description": "a Spark barrier stage on local[2]", "free": 2}
    assert backend.sc is spark.sparkContext  # the user's session, never an embedded one beside it


@pytest.mark.unit
def test_a_backend_list_whose_last_entry_declines_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "SPARK_BACKENDS", (lambda config: None,))
    with pytest.raises(RuntimeError, match=r"^no backend can run np=2: .* each declined; the last entry of "
                                           r"SPARK_BACKENDS \(runner/_backends/registry.py\) must always answer, as "
                                           r"spark.backend_for does\.$"):
        registry.backend_for(RunnerConfig(np=2))
