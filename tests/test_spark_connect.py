"""HorovodRunner under a Spark Connect session: the process holds a gRPC client, no SparkContext, no JVM.

One real Spark Connect server for the file (``spark-submit --class ...SparkConnectServer`` on ``local[2]``, from
the pip pyspark, bound to 127.0.0.1), and a client session on it, as a Databricks standard-access notebook or
Databricks Connect gives. The spine (np=2's value, np=-1, a failing rank's own error and the next run), an
elastic restart, and the converter's Parquet read by the ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _connect_server import connect_server, free_port

pytest.importorskip("grpc", reason="pyspark[connect]'s client needs grpcio (the test extra has it)")
pytest.importorskip("google.rpc", reason="pyspark[connect]'s client needs googleapis-common-protos")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

@pytest.fixture(scope="module")
def connect():
    """A Spark Connect server on local[2] and a client session on it; both gone, and the process back to classic
    sessions, at the end of the file."""
    from pyspark.sql import SparkSession

    with connect_server() as url:
        session = SparkSession.builder.remote(url).getOrCreate()
        try:
            yield session
        finally:
            session.stop()
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # pyspark's mark of a remote session: classic again


def _sum_of_ranks():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    return {"sum": hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item(), "size": hvd.size(),
            "rank": hvd.rank()}


def test_np2_runs_on_the_connect_servers_cluster_and_returns_every_value(connect):
    from sparkhvd import HorovodRunner
    from sparkhvd.runner._spark import _embedded

    runner = HorovodRunner(np=2)
    assert runner.run(_sum_of_ranks) == {"sum": 3.0, "size": 2, "rank": 0}
    result = runner.run_all(_sum_of_ranks)
    assert [v["rank"] for v in result.values] == [0, 1] and {v["sum"] for v in result.values} == {3.0}
    assert _embedded is None  # never an embedded session beside the user's Connect session
    from pyspark import SparkContext

    assert SparkContext._active_spark_context is None or "sparkhvd" not in SparkContext._active_spark_context.appName


def test_np_minus_one_runs_on_the_driver_beside_a_connect_session(connect):
    from sparkhvd import HorovodRunner

    assert HorovodRunner(np=-1).run(_sum_of_ranks) == {"sum": 1.0, "size": 1, "rank": 0}


def _rank_one_fails():
    import time

    import sparkhvd.collective.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("no such column: label")
    time.sleep(60)


def test_a_failing_ranks_own_error_heads_the_error_and_the_next_run_works(connect):
    from sparkhvd import HorovodRunError, HorovodRunner

    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=2).run(_rank_one_fails)
    assert str(info.value).splitlines()[0].endswith("failed: rank 1: KeyError: 'no such column: label'"), info.value
    assert HorovodRunner(np=2).run(_sum_of_ranks)["sum"] == 3.0


def _elastic(marks: str):
    import os
    import signal

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < 8:
            if state.step == 4 and hvd.rank() == 1 and not os.path.exists(os.path.join(marks, "killed")):
                _commits.flush(60)
                open(os.path.join(marks, "killed"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(10 * state.step + hvd.rank())
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            opt.step()
            state.step += 1
            state.commit()
        return [p.detach().clone() for p in model.parameters()]

    return loop(state)


def test_an_elastic_restart_under_connect_resumes_bit_for_bit(connect, tmp_path):
    from sparkhvd import HorovodRunner

    once = tmp_path / "reference"
    once.mkdir()
    (once / "killed").touch()  # the reference run is never killed
    reference = HorovodRunner(np=2).run(_elastic, marks=str(once))
    runner = HorovodRunner(np=2, max_restarts=1)
    weights = runner.run(_elastic, marks=str(tmp_path))
    (event,) = runner.last_result.restarts
    assert event.lost.startswith("rank 1's process") and event.commit == {"step": 4}, event
    assert all(a.equal(b) for a, b in zip(weights, reference))


def test_the_ranks_read_a_connect_dataframes_converter(connect, tmp_path):
    from sparkhvd import HorovodRunner
    from sparkhvd.data import make_spark_converter

    df = connect.range(0, 103, numPartitions=3).selectExpr("id", "cast(id as double) * 2 as x")
    converter = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri())

    def train():
        import sparkhvd.collective.torch as hvd

        hvd.init()
        ids = []
        with converter.make_torch_dataloader(batch_size=10, num_epochs=1) as loader:
            for batch in loader:
                ids += batch["id"].tolist()
        return ids

    values = HorovodRunner(np=2).run_all(train).values
    assert sorted(values[0] + values[1]) == list(range(103))  # every row once, over the two ranks
    converter.delete()


def test_more_ranks_than_the_servers_master_allows_fail_in_seconds_with_the_fix(connect):
    from sparkhvd import HorovodRunner

    with pytest.raises(RuntimeError) as info:
        HorovodRunner(np=3).run(_sum_of_ranks)
    assert str(info.value) == ("np=3 needs 3 task slots but the Spark Connect server's cluster has at most 2 "
                               "(local[2], spark.task.cpus=1); use np<=2, add executors or cores, or use np=-3 to run "
                               "on the driver.")


def test_sparkhvd_run_remote_runs_a_script_on_the_connect_server(connect, tmp_path):
    url = f"sc://127.0.0.1:{connect.client._builder.url.port}"  # the fixture's server
    (tmp_path / "train.py").write_text("import sys\nimport sparkhvd.collective.torch as hvd\nhvd.init()\n"
                                       "print('rank', hvd.rank(), 'of', hvd.size(), sys.argv[1:], flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    out = subprocess.run([sys.executable, "-m", "sparkhvd", "run", "--np", "2", "--remote", url, "train.py", "--lr",
                          "0.1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[0] rank 0 of 2 ['--lr', '0.1']" in out.stdout and "[1] rank 1 of 2" in out.stdout, out.stdout
    assert f"through Spark Connect ({url}, local[2])" in out.stdout


def test_an_unreachable_connect_server_fails_in_seconds_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    (tmp_path / "train.py").write_text("pass\n")
    url = f"sc://127.0.0.1:{free_port()}"  # nothing listens there
    out = subprocess.run([sys.executable, "-m", "sparkhvd", "run", "--np", "2", "--remote", url, "train.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"the Spark Connect server (sc://127.0.0.1:{url.rsplit(':', 1)[1]}) did not answer" in out.stderr, out.stderr
