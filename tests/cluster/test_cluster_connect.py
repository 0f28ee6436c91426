"""A Spark Connect client off the driver node: the executors have no route back to it.

The testbed gets two more namespaces for this test. One is the cluster's driver node, on the bridge (198.18.0.9),
running a real Spark Connect server whose executors run on the testbed's hosts. The other is the client's
"laptop" (198.18.0.201), linked to the driver node alone by a veth pair: the client reaches the server, and no
host has a route to the client. sparkhvd's pre-flight sees that spark.driver.host is not an address of the
client, and rank 0's task hosts the run's service. Each rank checks it cannot reach the client's address; the
values and the ranks' output come back through the stage's rows (errors and restarts through them:
tests/runner/backends/test_spark_connect.py's hosted case). The server's executors take
the core each worker has beside the testbed driver's executor (conftest.py), one executor a host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ._client import _pyspark_home, _set_parent_death_signal, _tail
from ._netns import DRIVER_ADDRESS, SUBNET, kill_netns_processes, sh

pytest.importorskip("grpc", reason="pyspark[connect]'s client needs grpcio (the test extra has it)")

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

HERE = os.path.dirname(os.path.abspath(__file__))
NODE, NODE_LINK, CLIENT = f"{SUBNET}.9", f"{SUBNET}.200", f"{SUBNET}.201"  # the driver node, its link, the laptop
PORT = 15002
_STARTED = "Spark Connect server started at"


@contextlib.contextmanager
def _namespaces(cluster):
    """The driver node on the bridge and the laptop linked to it alone; both removed at the end."""
    prefix = cluster.network.prefix
    node, laptop = f"{prefix}x", f"{prefix}y"  # names the testbed's sweep knows (_netns._NAME)
    try:
        sh("ip", "netns", "add", node)
        sh("ip", "link", "add", f"{node}0", "type", "veth", "peer", "name", "eth0", "netns", node)
        sh("ip", "link", "set", f"{node}0", "master", cluster.network.bridge)
        sh("ip", "link", "set", f"{node}0", "up")
        for args in (("lo", "up"), ("eth0", "up")):
            sh("ip", "netns", "exec", node, "ip", "link", "set", *args)
        sh("ip", "netns", "exec", node, "ip", "addr", "add", f"{NODE}/24", "dev", "eth0")
        sh("ip", "netns", "add", laptop)
        sh("ip", "link", "add", f"{laptop}0", "type", "veth", "peer", "name", "eth0", "netns", laptop)
        sh("ip", "link", "set", f"{laptop}0", "netns", node)
        for ns, dev, mine, theirs in ((node, f"{laptop}0", NODE_LINK, CLIENT), (laptop, "eth0", CLIENT, NODE_LINK)):
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{mine}/32", "dev", dev)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            sh("ip", "netns", "exec", ns, "ip", "route", "add", f"{theirs}/32", "dev", dev)
        yield node, laptop
    finally:
        for ns in (laptop, node):
            kill_netns_processes(ns)
            sh("ip", "netns", "delete", ns, check=False)
        sh("ip", "link", "delete", f"{node}0", check=False)


@contextlib.contextmanager
def _connect_server(cluster, node: str, folder: str):
    """A Spark Connect server on the driver node, its executors (one core each) on the testbed's two hosts."""
    home = _pyspark_home()
    log_path = os.path.join(folder, "server.log")
    java_opts = ("-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:+UnlockDiagnosticVMOptions "
                 f"-XX:-BytecodeVerificationRemote -Djava.io.tmpdir={folder}")
    conf = {"spark.driver.host": NODE, "spark.driver.bindAddress": NODE,
            "spark.connect.grpc.binding.address": NODE_LINK, "spark.connect.grpc.binding.port": str(PORT),
            "spark.executor.cores": "1", "spark.cores.max": "2", "spark.executor.memory": "512m",
            "spark.executor.extraJavaOptions": java_opts, "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.dynamicAllocation.enabled": "false", "spark.ui.enabled": "false", "spark.local.dir": folder}
    env = dict(os.environ, SPARK_HOME=home, SPARK_CONF_DIR=cluster.conf_dir, PYSPARK_PYTHON=sys.executable,
               TMPDIR=folder, SPARK_LOCAL_IP=NODE)
    env.pop("SPARK_REMOTE", None)
    command = ["ip", "netns", "exec", node, os.path.join(home, "bin", "spark-submit"), "--class",
               "org.apache.spark.sql.connect.service.SparkConnectServer", "--master",
               f"spark://{DRIVER_ADDRESS}:7077", "--driver-java-options", java_opts]
    for key, value in conf.items():
        command += ["--conf", f"{key}={value}"]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command + ["spark-internal"], stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, env=env, cwd=folder, start_new_session=True,
                                  preexec_fn=_set_parent_death_signal)
    try:
        deadline = time.monotonic() + 120
        while True:  # started, and both executors registered: the barrier stage's slots exist
            text = open(log_path, errors="replace").read()
            if _STARTED in text and text.count("Registered executor") >= 2:
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the Connect server did not start (exit {server.poll()}):\n{_tail(log_path, 30)}")
            time.sleep(0.2)
        yield f"sc://{NODE_LINK}:{PORT}", log_path
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


@pytest.fixture
def connect_off_the_cluster(cluster):
    """(the server's URL, the laptop's namespace, the server's log); its executors gone afterwards, so that the
    next tests find one executor a host."""
    folder = tempfile.mkdtemp(prefix="sparkhvd-connect-node-", dir=cluster.base_dir)
    try:
        with _namespaces(cluster) as (node, laptop), _connect_server(cluster, node, folder) as (url, log_path):
            yield url, laptop, log_path
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        deadline = time.monotonic() + 30
        while any(len(cluster.executor_pids(h)) > 1 for h in cluster.hosts) and time.monotonic() < deadline:
            time.sleep(0.2)


def test_a_connect_client_the_executors_cannot_reach_runs_with_rank_0s_task_hosting_the_service(
        connect_off_the_cluster, cluster, no_leftover_ranks):
    url, laptop, log_path = connect_off_the_cluster
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}
    env["TMPDIR"] = cluster._dir("laptop", "tmp")  # its log folders go with the testbed
    started = time.monotonic()
    done = subprocess.run(["ip", "netns", "exec", laptop, sys.executable, os.path.join(HERE, "_connect_client.py"),
                           url, CLIENT], env=env, capture_output=True, text=True, timeout=240, cwd=cluster.base_dir)
    print(f"\n[cluster] the client off the cluster: {time.monotonic() - started:.1f} s for its run", flush=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{_tail(log_path, 30)}"
    got = json.loads(lines[-1][len("RESULT "):])
    assert "failed" not in got, got["failed"]
    assert (f"this client is not on the Spark driver's node (spark.driver.host={NODE}), so the executors cannot reach "
            "it: rank 0's Spark task hosts the run's service") in done.stdout, done.stdout[-3000:]
    values = got["values"]
    assert [v["rank"] for v in values] == [0, 1] and {v["sum"] for v in values} == {3.0}, values
    assert {v["host"] for v in values} == {h.hostname for h in cluster.hosts}, values  # one rank on each host
    assert {v["reach"] for v in values} <= {"OSError", "TimeoutError"}, values  # no route from a host to the client
    for rank, v in enumerate(values):
        assert f"rank {rank} on {v['host']}" in got["logs"][str(rank)], got["logs"]  # the output, in the rows
        assert f"[{rank}] rank {rank} on {v['host']}" in done.stdout  # and printed on the client
