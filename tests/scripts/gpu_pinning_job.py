"""Run on local-cluster[2,1,1024] whose workers (on this one host) each discover one fake GPU; print each rank's view."""

import json
import os
import sys

from _spark_work import remove_app_work_dir
from pyspark.sql import SparkSession

from sparkhvd import HorovodRunner

spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("gpu-pinning")
         .config("spark.ui.enabled", "false")
         .config("spark.worker.resource.gpu.amount", "1")
         .config("spark.worker.resource.gpu.discoveryScript", sys.argv[1])
         .config("spark.executor.resource.gpu.amount", "1")
         .config("spark.executor.resource.gpu.discoveryScript", sys.argv[1])
         .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
         .getOrCreate())


def train():
    from sparkhvd._common import context as _context

    placement = _context.current().placement
    return {"rank": placement.rank, "local_rank": placement.local_rank, "own": list(placement.cuda_devices),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


runs = []
for _ in range(2):  # the second run reuses Spark's Python workers
    result = HorovodRunner(np=2).run_all(train)
    runs.append({"values": result.values, "gpus": result.gpus})
print("RESULT " + json.dumps(runs), flush=True)
app_id = spark.sparkContext.applicationId
spark.stop()
remove_app_work_dir(app_id)
