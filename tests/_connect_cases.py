"""The cases of tests/runner/backends/test_spark_connect.py, run in a process that holds a Spark Connect session and nothing else.

pyspark refuses a remote session in a process that already has a classic one (pytest's workers do), and a user's
notebook on Databricks Connect has only the remote one: so the cases run here, one after the other, each
recording its value or its error, and the tests read them back.

    python _connect_cases.py sc://127.0.0.1:PORT FOLDER    # writes FOLDER/results.json
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def sum_of_ranks():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    return {"sum": hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item(), "size": hvd.size(),
            "rank": hvd.rank()}


def rank_one_fails():
    import time

    import sparkhvd.collective.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("no such column: label")
    time.sleep(60)


def elastic(marks: str):
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


def case_np2(spark, folder):
    from pyspark import SparkContext

    from sparkhvd import HorovodRunner

    runner = HorovodRunner(np=2)
    value = runner.run(sum_of_ranks)
    every = runner.run_all(sum_of_ranks).values
    return {"value": value, "every": every, "description": _description(),
            "classic_context": SparkContext._active_spark_context is not None}


def _description() -> str:
    from sparkhvd.runner._backends.connect import ConnectLauncher, remote_session

    return ConnectLauncher(remote_session(), 2).description


def case_np_minus_one(spark, folder):
    from sparkhvd import HorovodRunner

    return HorovodRunner(np=-1).run(sum_of_ranks)


def case_failing_rank(spark, folder):
    from sparkhvd import HorovodRunError, HorovodRunner

    try:
        HorovodRunner(np=2).run(rank_one_fails)
        error = None
    except HorovodRunError as exc:
        error = str(exc)
    return {"error": error, "next": HorovodRunner(np=2).run(sum_of_ranks)}


_REFERENCE: list = []  # case_restart's weights of the run never killed: case_hosted's reference too


def case_restart(spark, folder):
    from sparkhvd import HorovodRunner

    once = os.path.join(folder, "reference")
    os.makedirs(once)
    open(os.path.join(once, "killed"), "w").close()  # the reference run is never killed
    reference = _REFERENCE[:] = HorovodRunner(np=2).run(elastic, marks=once)
    marks = os.path.join(folder, "restart")
    os.makedirs(marks)
    runner = HorovodRunner(np=2, max_restarts=1)
    weights = runner.run(elastic, marks=marks)
    return {"restarts": [{"lost": e.lost, "commit": e.commit} for e in runner.last_result.restarts],
            "same": len(weights) == len(reference) and all(a.equal(b) for a, b in zip(weights, reference))}


def case_converter(spark, folder):
    from sparkhvd import HorovodRunner
    from sparkhvd.data import make_spark_converter

    df = spark.range(0, 103, numPartitions=3).selectExpr("id", "cast(id as double) * 2 as x")
    converter = make_spark_converter(df, parent_cache_dir_url="file://" + os.path.join(folder, "cache"))

    def train():
        import sparkhvd.collective.torch as hvd

        hvd.init()
        ids = []
        with converter.make_torch_dataloader(batch_size=10, num_epochs=1) as loader:
            for batch in loader:
                ids += batch["id"].tolist()
        return ids

    values = HorovodRunner(np=2).run_all(train).values
    converter.delete()
    return {"ids": sorted(values[0] + values[1]), "left": os.listdir(os.path.join(folder, "cache"))}


def case_np3(spark, folder):
    from sparkhvd import HorovodRunner

    try:
        HorovodRunner(np=3).run(sum_of_ranks)
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


def case_backend_contract(spark, folder):
    from _backend_contract import check_backend

    from sparkhvd.runner._backends import registry
    from sparkhvd.runner._runner_config import RunnerConfig

    return check_backend(registry.backend_for(RunnerConfig(np=2)), 2)


def chatty():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    print(f"hello from rank {hvd.rank()} of {hvd.size()}", flush=True)
    return sum_of_ranks()


class _TaskHosted:
    """Within it, rank 0's task hosts each run's service (SPARKHVD_CONNECT_SERVICE=task), as for a client the
    executors cannot reach."""

    def __enter__(self):
        os.environ["SPARKHVD_CONNECT_SERVICE"] = "task"

    def __exit__(self, *exc):
        os.environ.pop("SPARKHVD_CONNECT_SERVICE", None)


def case_hosted(spark, folder):
    from sparkhvd import HorovodRunError, HorovodRunner

    with _TaskHosted():
        runner = HorovodRunner(np=2, log_dir=os.path.join(folder, "hosted-logs"))
        every = runner.run_all(chatty)
        logs = {rank: open(path).read() for rank, path in every.log_paths.items()}
        try:
            HorovodRunner(np=2).run(rank_one_fails)
            error = None
        except HorovodRunError as exc:
            error = str(exc)
        marks = os.path.join(folder, "hosted-restart")
        os.makedirs(marks)
        restarting = HorovodRunner(np=2, max_restarts=1)
        weights = restarting.run(elastic, marks=marks)
    reference = _REFERENCE  # case_restart's run that was never killed, nor hosted
    return {"every": every.values, "logs": logs, "hosts": every.hosts, "error": error,
            "restarts": [{"lost": e.lost, "commit": e.commit, "kind": e.kind} for e in restarting.last_result.restarts],
            "same": len(weights) == len(reference) and all(a.equal(b) for a, b in zip(weights, reference))}


def main(url: str, folder: str) -> None:
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(url).getOrCreate()
    results = {}
    for name, case in [(n, f) for n, f in globals().items() if n.startswith("case_")]:
        try:
            results[name[5:]] = {"ok": case(spark, folder)}
        except BaseException as exc:  # noqa: BLE001 - each case's error is its test's report
            results[name[5:]] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f, default=repr)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
