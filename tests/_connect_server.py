"""A real Spark Connect server for tests and benchmarks: the pip pyspark's ``spark-submit --class
org.apache.spark.sql.connect.service.SparkConnectServer`` on ``local[N]``, bound to 127.0.0.1, in a temp folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

_STARTED = "Spark Connect server started at"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def connect_server(master: str = "local[2]", timeout: float = 120):
    """Start the server; yields its ``sc://127.0.0.1:PORT`` URL; stops it and removes its folder at the end.
    RuntimeError, with the end of its log, when it does not start within ``timeout`` seconds."""
    import pyspark

    from sparkhvd.runner._backends.java import check_java

    check_java()
    home = os.path.dirname(os.path.abspath(pyspark.__file__))
    folder = tempfile.mkdtemp(prefix="sparkhvd-connect-")
    port = free_port()
    log_path = os.path.join(folder, "server.log")
    env = dict(os.environ, SPARK_HOME=home, PYSPARK_PYTHON=sys.executable, TMPDIR=folder, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("SPARK_REMOTE", None)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [os.path.join(home, "bin", "spark-submit"), "--class",
             "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", master,
             "--driver-java-options", f"-Djava.io.tmpdir={folder}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1", "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.driver.bindAddress=127.0.0.1", "--conf", "spark.driver.host=127.0.0.1",
             "--conf", "spark.ui.enabled=false", "--conf", f"spark.local.dir={folder}", "spark-internal"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while _STARTED not in open(log_path, errors="replace").read():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Spark Connect server did not start (exit {server.poll()}); its log ends:\n"
                                   + open(log_path, errors="replace").read()[-3000:])
            time.sleep(0.2)
        yield f"sc://127.0.0.1:{port}"
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
