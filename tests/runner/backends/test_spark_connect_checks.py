"""The checks before a run under Spark Connect, each a sentence with the values and the fix: where the driver
service can listen, the slots a server's master allows, a missing Connect client. (Runs on a real server:
tests/runner/backends/test_spark_connect.py.)"""

from __future__ import annotations

import sys

import pytest

from sparkhvd.runner._backends import connect as _spark_connect
from sparkhvd.runner._backends.connect import bind_host, slots_bound

pytestmark = pytest.mark.unit


class FakeConf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


@pytest.mark.parametrize("master, conf, bound", [
    ("local", {}, 1), ("local[4]", {}, 4), ("local[4]", {"spark.task.cpus": "2"}, 2), ("local[3, 2]", {}, 3),
    ("local[*]", {}, None), ("local-cluster[2,2,1024]", {}, 4), ("spark://m:7077", {"spark.cores.max": "6"}, 6),
    ("spark://m:7077", {}, None), ("yarn", {}, None)])
def test_the_slots_a_servers_master_allows(master, conf, bound):
    assert slots_bound(master, FakeConf(conf)) == bound


def test_local_masters_serve_on_loopback_and_others_on_the_drivers_own_address():
    assert bind_host("local[2]", "10.1.2.3") == "127.0.0.1"
    assert bind_host("spark://m:7077", "127.0.0.1") == "127.0.0.1"


def test_a_client_off_the_driver_node_told_to_serve_the_ranks_is_told_so_with_the_address():
    # only where SPARKHVD_CONNECT_SERVICE=client: by default rank 0's task hosts the service then (test_spark_connect.py)
    with pytest.raises(RuntimeError) as info:
        bind_host("spark://m:7077", "198.18.0.77")  # the test range: never an address of this machine
    assert str(info.value) == (
        "under Spark Connect the ranks reach this process at the Spark driver's address, "
        "spark.driver.host=198.18.0.77, but 198.18.0.77 is not an address of this machine: this client does not run "
        "on the cluster's driver node (Databricks Connect from a laptop, say), and the executors cannot reach it. Run "
        "the notebook or script on the cluster (a notebook attached to it, or a job), unset SPARKHVD_CONNECT_SERVICE "
        "(now client) so that rank 0's task hosts the run's service, or use np<0 to run on this machine.")


def test_a_server_without_a_driver_host_is_refused_with_the_fix():
    with pytest.raises(RuntimeError) as info:
        bind_host("yarn", None)
    assert str(info.value) == ("under Spark Connect the ranks reach this process at the Spark driver's address, but the "
                               "server's spark.driver.host is not set; run the notebook on the cluster's driver node, "
                               "unset SPARKHVD_CONNECT_SERVICE (now client) so that rank 0's task hosts the run's "
                               "service, or use np<0 to run on this machine.")


def test_a_connect_service_place_other_than_auto_client_or_task_is_refused_with_the_choices(monkeypatch):
    from sparkhvd._common import settings

    monkeypatch.setenv("SPARKHVD_CONNECT_SERVICE", "laptop")
    with pytest.raises(ValueError) as info:
        settings.CONNECT_SERVICE.get()
    assert str(info.value) == (
        "SPARKHVD_CONNECT_SERVICE='laptop' is not auto, client or task; use auto (the default), client (the ranks "
        "reach this process) or task (rank 0's task hosts the run's service).")


def test_no_connect_session_and_no_spark_remote_means_a_classic_run(monkeypatch):
    monkeypatch.delenv("SPARK_CONNECT_MODE_ENABLED", raising=False)
    monkeypatch.delenv("SPARK_REMOTE", raising=False)
    assert _spark_connect.remote_session() is None


def test_spark_remote_without_the_connect_client_says_what_to_install(monkeypatch):
    monkeypatch.setenv("SPARK_REMOTE", "sc://db.example:443")
    monkeypatch.setitem(sys.modules, "pyspark.sql.connect.session", None)  # as where pyspark[connect] is missing
    with pytest.raises(RuntimeError) as info:
        _spark_connect.remote_session()
    assert str(info.value).startswith("this process is set up for Spark Connect (SPARK_REMOTE='sc://db.example:443') "
                                      "but pyspark's Connect client cannot be imported (")
    assert str(info.value).endswith("); pip install 'pyspark[connect]', or unset SPARK_REMOTE to use a classic session.")


def test_train_on_dataframe_under_a_connect_session_is_refused_with_the_way(monkeypatch):
    from sparkhvd.runner._runner_config import RunnerConfig

    monkeypatch.setattr(_spark_connect, "remote_session", lambda: object())  # a Connect session is active
    with pytest.raises(RuntimeError, match=r"^TorchDistributor\._train_on_dataframe runs its barrier stage over the "
                                           r"DataFrame through the SparkContext, which a Spark Connect session does "
                                           r"not have; call it on a classic SparkSession"):
        _spark_connect.backend_for(RunnerConfig(2, dataframe=object()))
