"""HorovodRunner under a Spark Connect session: the process holds a gRPC client, no SparkContext, no JVM.

One real Spark Connect server for the file (``spark-submit --class ...SparkConnectServer`` on ``local[2]``, from
the pip pyspark, bound to 127.0.0.1: tests/_connect_server.py). The cases run in a client process of their own
(tests/_connect_cases.py), as a Databricks Connect notebook holds only its remote session (pyspark refuses one
in a process with a classic session, as pytest's workers have): the spine (np=2's values, np=-1, a failing
rank's own error and the next run), an elastic restart, the converter's Parquet read by the ranks, np above the
server's slots. Then ``sparkhvd run --remote``, and an unreachable server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _connect_server import connect_server, free_port
from _paths import TESTS

pytest.importorskip("grpc", reason="pyspark[connect]'s client needs grpcio (the test extra has it)")
pytest.importorskip("google.rpc", reason="pyspark[connect]'s client needs googleapis-common-protos")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES = os.path.join(TESTS, "_connect_cases.py")


def _client_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}


@pytest.fixture(scope="module")
def connect(tmp_path_factory):
    """The server's URL and what each case of tests/_connect_cases.py gave on it (its value, or its error)."""
    folder = tmp_path_factory.mktemp("connect-cases")
    with connect_server() as url:
        done = subprocess.run([sys.executable, CASES, url, str(folder)], env=_client_env(), capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        with open(folder / "results.json") as f:
            yield url, json.load(f)


def result(connect, case: str):
    outcome = connect[1][case]
    assert "ok" in outcome, outcome.get("traceback") or outcome
    return outcome["ok"]


def test_np2_runs_on_the_connect_servers_cluster_and_returns_every_value(connect):
    got = result(connect, "np2")
    assert got["value"] == {"sum": 3.0, "size": 2, "rank": 0}
    assert [v["rank"] for v in got["every"]] == [0, 1] and {v["sum"] for v in got["every"]} == {3.0}
    assert not got["classic_context"]  # never an embedded session beside the user's Connect session
    assert got["description"] == f"a Spark barrier stage through Spark Connect ({connect[0]}, local[2])"


def test_np_minus_one_runs_on_the_driver_beside_a_connect_session(connect):
    assert result(connect, "np_minus_one") == {"sum": 1.0, "size": 1, "rank": 0}


def test_a_failing_ranks_own_error_heads_the_error_and_the_next_run_works(connect):
    got = result(connect, "failing_rank")
    assert got["error"].splitlines()[0].endswith("failed: rank 1: KeyError: 'no such column: label'"), got["error"]
    assert got["next"]["sum"] == 3.0


def test_an_elastic_restart_under_connect_resumes_bit_for_bit(connect):
    got = result(connect, "restart")
    (event,) = got["restarts"]
    assert event["lost"].startswith("rank 1's process") and event["commit"] == {"step": 4}, event
    assert got["same"]


def test_the_ranks_read_a_connect_dataframes_converter(connect):
    got = result(connect, "converter")
    assert got["ids"] == list(range(103))  # every row once, over the two ranks
    assert got["left"] == []  # converter.delete() removed its folder


def test_more_ranks_than_the_servers_master_allows_fail_in_seconds_with_the_fix(connect):
    assert result(connect, "np3")["error"] == (
        "np=3 needs 3 task slots but the Spark Connect server's cluster has at most 2 (local[2], spark.task.cpus=1); "
        "use np<=2, add executors or cores, or use np=-3 to run on the driver.")


def test_the_connect_backend_keeps_the_backend_contract(connect):
    got = result(connect, "backend_contract")  # tests/_backend_contract.py, on the real server
    assert got == {"name": "connect", "bind_host": "127.0.0.1", "free": 0,
                   "description": f"a Spark barrier stage through Spark Connect ({connect[0]}, local[2])"}


def test_with_rank_0s_task_hosting_the_service_values_output_errors_and_restarts_come_back_in_rows(connect):
    got = result(connect, "hosted")  # SPARKHVD_CONNECT_SERVICE=task: what a client off the cluster gets
    assert [v["rank"] for v in got["every"]] == [0, 1] and {v["sum"] for v in got["every"]} == {3.0}
    assert "hello from rank 0 of 2" in got["logs"]["0"] and "hello from rank 1 of 2" in got["logs"]["1"], got["logs"]
    assert got["error"].splitlines()[0].endswith("failed: rank 1: KeyError: 'no such column: label'"), got["error"]
    (event,) = got["restarts"]  # rank 1 killed at step 4: relaunched from the commit that came back in the rows
    assert event["lost"].startswith("rank 1's process") and event["commit"] == {"step": 4}, event
    assert got["same"]  # bit for bit the run that was never killed


def test_sparkhvd_run_remote_runs_a_script_on_the_connect_server(connect, tmp_path):
    url = connect[0]
    (tmp_path / "train.py").write_text("import sys\nimport sparkhvd.collective.torch as hvd\nhvd.init()\n"
                                       "print('rank', hvd.rank(), 'of', hvd.size(), sys.argv[1:], flush=True)\n")
    out = subprocess.run([sys.executable, "-m", "sparkhvd", "run", "--np", "2", "--remote", url, "train.py", "--lr",
                          "0.1"], cwd=tmp_path, env=_client_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[0] rank 0 of 2 ['--lr', '0.1']" in out.stdout and "[1] rank 1 of 2" in out.stdout, out.stdout
    assert f"through Spark Connect ({url}, local[2])" in out.stdout


def test_an_unreachable_connect_server_fails_in_seconds_naming_it(tmp_path):
    (tmp_path / "train.py").write_text("pass\n")
    url = f"sc://127.0.0.1:{free_port()}"  # nothing listens there
    out = subprocess.run([sys.executable, "-m", "sparkhvd", "run", "--np", "2", "--remote", url, "train.py"],
                         cwd=tmp_path, env=_client_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    line = f"sparkhvd run: RuntimeError: the Spark Connect server ({url}) did not answer: Connection refused; check"
    assert any(x.startswith(line) for x in out.stderr.splitlines()), out.stderr  # pyspark may warn first (pandas)
