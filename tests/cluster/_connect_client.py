"""The client of tests/cluster/test_cluster_connect.py: a Spark Connect session and nothing else, run in a namespace
of its own that the executors have no route to (a laptop on Databricks Connect, say).

    python _connect_client.py sc://HOST:PORT CLIENT_ADDRESS    # prints one JSON line: what each run gave
"""

from __future__ import annotations

import json
import sys
import traceback


def where_am_i(client: str):
    import socket

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    print(f"rank {hvd.rank()} on {socket.gethostname()}", flush=True)
    try:  # the client's own address, from the rank's host: no route, so nothing sparkhvd did could have used it
        socket.create_connection((client, 9), timeout=3).close()
        reach = "connected"
    except OSError as exc:
        reach = type(exc).__name__
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "host": socket.gethostname(), "sum": total, "reach": reach}


def main(url: str, client: str) -> None:
    from pyspark.sql import SparkSession

    from sparkhvd import HorovodRunner

    spark = SparkSession.builder.remote(url).getOrCreate()
    got: dict = {}
    try:
        result = HorovodRunner(np=2).run_all(where_am_i, client=client)
        got["values"] = result.values
        got["logs"] = {rank: open(path).read() for rank, path in result.log_paths.items()}
    except BaseException as exc:  # noqa: BLE001 - the test prints it
        got["failed"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    print("RESULT " + json.dumps(got), flush=True)
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
