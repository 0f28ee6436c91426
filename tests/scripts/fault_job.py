"""Driver for tests/runner/test_faults.py: faults during runs on one local-cluster application; prints RESULT <json>
for each.

``executor``: kill -9 the executor JVM of one rank (then a run that works, and np above the slots). ``stop``:
spark.stop() from another thread, last, as it ends the application.
"""

import json
import sys
import threading
import time

import psutil
from pyspark.sql import SparkSession

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd.runner._backends.spark import task_slots
from sparkhvd.runner._warm.protocol import WORKER_MODULE


def train():
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    print("in the loop", flush=True)
    t = torch.ones(4)
    end = time.time() + 100
    while time.time() < end:
        hvd.allreduce(t)
        time.sleep(0.01)
    return 1


def rank_processes():
    """This driver's rank processes (under its JVM's executors), not other runs' on the machine."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and WORKER_MODULE in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def main(faults):
    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("OFF")
    app_id = spark.sparkContext.applicationId
    try:
        for fault in faults:
            _faulted_run(spark, fault)
    finally:
        remove_app_work_dir(app_id)


def _faulted_run(spark, fault):
    faulted = []

    def inject():
        deadline = time.monotonic() + 120
        while len(rank_processes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # inside the allreduce loop
        if fault == "executor":
            victim = rank_processes()[-1]
            while victim is not None and "CoarseGrainedExecutorBackend" not in " ".join(victim.cmdline()):
                victim = victim.parent()
            faulted.append(time.monotonic())
            victim.kill()
        else:
            faulted.append(time.monotonic())
            spark.stop()

    refused = ""
    if fault == "executor":  # np above the slots on a cluster: refused as soon as the count is known
        started = time.monotonic()
        try:
            HorovodRunner(np=3).run(train)
        except RuntimeError as exc:
            refused = f"{time.monotonic() - started:.1f} s: {exc}"
    threading.Thread(target=inject, daemon=True).start()
    error = ""
    try:
        HorovodRunner(np=2).run(train)
    except HorovodRunError as exc:
        error = str(exc)
    seconds = time.monotonic() - faulted[0] if faulted else -1
    time.sleep(0.5)
    left = [p.pid for p in rank_processes()]
    nxt = None
    if fault == "executor":
        # the replacement executor JVM can take longer than the slot check's own wait to start on a loaded machine:
        # this run shows that one works after the fault, not how fast Spark replaces an executor
        deadline = time.monotonic() + 120
        while task_slots(spark.sparkContext) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        nxt = HorovodRunner(np=2).run(lambda: 7)
    print("RESULT " + json.dumps({"fault": fault, "error": error, "seconds": seconds, "left": left, "next": nxt,
                                  "refused": refused}), flush=True)


if __name__ == "__main__":
    from _spark_work import remove_app_work_dir

    main(sys.argv[1:])
