"""The tasks of a hosted attempt's barrier stage under Spark Connect (connect.py's HostedLauncher starts it): rank 0's task serves the attempt, and its outcome comes
back as the stage's rows (runner/_policy/hosted.py says what is in them and why).

Partition 0's task starts the attempt's driver service on its executor's address (the one Spark's driver and the
other executors reach it at), tells the other tasks where through ``BarrierTaskContext.allGather``, runs its own
agent and the attempt's watch, and yields the signed outcome in rows of a few MiB. The other tasks run their agents
against that address and yield nothing. The client reads the rows with ``toLocalIterator``, which Spark Connect
streams partition by partition: partition 0's arrive as soon as that task ends.
"""

from __future__ import annotations

import dataclasses
import json

from ..._common.network import local_address
from .._agent.agent import run_task
from .._shared.signed import chunks

SCHEMA = "chunk binary"


def hosting_task(attempt, batches):
    """Runs inside each barrier task: partition 0 hosts the attempt and yields its signed outcome; the others run
    their agents against it and yield nothing."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:  # the task's one input row
        pass
    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    gpu = ctx.resources().get("gpu")
    gpus = list(gpu.addresses) if gpu is not None else []
    spark_task = (ctx.stageId(), ctx.taskAttemptId())

    def run_agent(address) -> dict:
        spec = dataclasses.replace(attempt.task, address=(address[0], int(address[1])))
        return run_task(spec, partition, gpus=gpus, spark_task=spark_task)

    if partition:
        run_agent(json.loads(ctx.allGather("")[0]))
        return
    blob = attempt.host(_serving_address(ctx), lambda address: ctx.allGather(json.dumps(list(address))), run_agent)
    for chunk in chunks(blob):
        yield pa.RecordBatch.from_pydict({"chunk": [chunk]}, schema=pa.schema([("chunk", pa.binary())]))


def _serving_address(ctx) -> str:
    """Where partition 0's task serves: its address toward another task's executor (a hostname may resolve to
    loopback on its own host, as Debian's 127.0.1.1), or its executor's address where every task shares it."""
    hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
    own = hosts[ctx.partitionId()]
    other = next((h for h in hosts if h != own), None)
    if other is None:
        return own
    try:
        return local_address(other)
    except OSError:  # no route this host can tell: Spark's name for the executor, as before
        return own
