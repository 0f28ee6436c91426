"""The cluster tests' driver process: ``python _driver.py '<config json>'`` (started by ``_cluster.Driver``).

Starts a SparkSession on the standalone master, waits until every executor has registered,
then answers requests read from stdin (one base64 pickle per line) with responses on stdout
(one line each, after a marker; everything else on stdout is the run's own output). Ends when
stdin closes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import sys
import tempfile
import time
import traceback

MARK = "@@sparkhvd-cluster-driver@@ "
READY_TIMEOUT_S = 90.0


def respond(message: dict) -> None:
    sys.stdout.write(MARK + base64.b64encode(pickle.dumps(message)).decode() + "\n")
    sys.stdout.flush()


def session(config: dict):
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(config["master"]).appName("sparkhvd-cluster-tests")
               .config("spark.driver.host", "198.18.0.1")
               .config("spark.driver.bindAddress", "198.18.0.1")
               .config("spark.executor.cores", "2")
               .config("spark.executor.memory", "512m")
               # One executor per host holding both of its GPUs, one GPU per task: 2 task slots per host.
               .config("spark.executor.resource.gpu.amount", "2")
               .config("spark.task.resource.gpu.amount", "1")
               # java.io.tmpdir: the session's temp dir (TMPDIR, removed at its end), where Spark extracts liblz4-java
               .config("spark.executor.extraJavaOptions", "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 "
                                                          "-XX:+UnlockDiagnosticVMOptions "
                                                          "-XX:-BytecodeVerificationRemote "
                                                          f"-Djava.io.tmpdir={tempfile.gettempdir()}")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.dynamicAllocation.enabled", "false")
               .config("spark.decommission.enabled", "true")  # SIGPWR to an executor decommissions it
               .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable))
    for key, value in config.get("executor_env", {}).items():
        builder = builder.config(f"spark.executorEnv.{key}", str(value))
    for key, value in config.get("conf", {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def executors(sc) -> list:
    infos = sc._jsc.sc().statusTracker().getExecutorInfos()  # the driver's own entry included
    return [{"host": e.host(), "port": e.port(), "running_tasks": e.numRunningTasks()} for e in infos
            if e.host() != sc.getConf().get("spark.driver.host")]


def wait_ready(sc, config: dict) -> dict:
    """Handshake: wait until every worker's executor has registered and all task slots exist."""
    from sparkhvd.runner._backends.spark import task_slots

    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        found, slots = executors(sc), task_slots(sc)
        if len(found) >= config["executors"] and slots >= config["slots"]:
            return {"executors": found, "slots": slots}
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{len(found)} of {config['executors']} executors ({slots} of {config['slots']} "
                               f"task slots) registered within {READY_TIMEOUT_S:.0f} s: {found}")
        time.sleep(0.1)


def run(request: dict) -> dict:
    import _jobs

    from sparkhvd import HorovodRunner

    fn = getattr(_jobs, request["job"])
    started = time.monotonic()
    try:
        if request.get("runner") == "TorchDistributor":  # the drop-in: rank 0's value only
            from sparkhvd import TorchDistributor

            value = TorchDistributor(num_processes=request["np"], local_mode=False, use_gpu=True).run(
                fn, **request.get("kwargs", {}))
            return {"ok": True, "seconds": time.monotonic() - started, "values": [value]}
        if request.get("runner") == "MirroredStrategyRunner":  # the drop-in, outside TensorFlow's strategy: the chief's
            from sparkhvd import MirroredStrategyRunner

            value = MirroredStrategyRunner(num_slots=request["np"], use_custom_strategy=True).run(
                fn, **request.get("kwargs", {}))
            return {"ok": True, "seconds": time.monotonic() - started, "values": [value]}
        runner = HorovodRunner(np=request["np"], **request.get("runner", {}))
        saved = {key: os.environ.get(key) for key in request.get("driver_env", {})}
        os.environ.update(request.get("driver_env", {}))  # settings the driver reads (the straggler line's)
        try:
            result = runner.run_all(fn, **request.get("kwargs", {}))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    except BaseException as exc:  # noqa: BLE001 - the test reads the error
        return {"ok": False, "seconds": time.monotonic() - started, "error_type": type(exc).__name__,
                "error": str(exc) or repr(exc)}
    return {"ok": True, "seconds": time.monotonic() - started, "values": result.values, "hosts": result.hosts,
            "placements": [p.as_dict() for p in result.placements], "gpus": result.gpus,
            "restarts": [dataclasses.asdict(e) for e in result.restarts]}


def main() -> None:
    config = json.loads(sys.argv[1])
    started = time.monotonic()
    try:
        spark = session(config)
        info = wait_ready(spark.sparkContext, config)
    except BaseException as exc:
        respond({"id": "ready", "ok": False, "error": "".join(traceback.format_exception_only(type(exc), exc))})
        raise
    respond({"id": "ready", "ok": True, "seconds": time.monotonic() - started, "pid": os.getpid(), **info})
    for line in sys.stdin:
        request = pickle.loads(base64.b64decode(line))
        try:
            if request["op"] == "run":
                answer = run(request)
            elif request["op"] == "executors":
                answer = {"executors": executors(spark.sparkContext)}
            else:
                answer = {"error": f"unknown op {request['op']!r}"}
        except BaseException as exc:  # noqa: BLE001 - answer, keep serving
            answer = {"ok": False, "error_type": type(exc).__name__, "error": traceback.format_exc(), "seconds": 0.0}
        respond({"id": request["id"], **answer})
    spark.stop()


if __name__ == "__main__":
    main()
