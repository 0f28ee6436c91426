"""GPU visibility on a real standalone cluster (local-cluster) whose workers discover fake GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _paths import SCRIPTS


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_rank_sees_this_jobs_gpus_on_its_host_in_local_rank_order(tmp_path):
    env = dict(os.environ, SPARKHVD_FAKE_GPU_DIR=str(tmp_path), PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_pinning_job.py"),
                           os.path.join(SCRIPTS, "gpu_discovery.sh")],
                          capture_output=True, text=True, env=env, timeout=220)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run in json.loads(lines[0][len("RESULT "):]):
        # Both workers run on this host, each with one GPU (Spark's address "0" or "1"): ranks 0 and 1 are
        # local ranks 0 and 1, and each lists both GPUs, its own at its local_rank (Horovod's set_device idiom).
        assert sorted(g[0] for g in run["gpus"]) == ["0", "1"], run  # one distinct GPU per rank, from Spark
        in_order = ",".join(g[0] for g in run["gpus"])  # RunResult.gpus is by rank: here, local-rank order
        assert run["values"] == [{"rank": r, "local_rank": r, "own": [r], "cuda": in_order} for r in range(2)], run
        assert [v["cuda"].split(",")[v["local_rank"]] for v in run["values"]] == [g[0] for g in run["gpus"]]
