"""GPU pinning on a real standalone cluster (local-cluster) whose workers discover fake GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_rank_sees_only_its_own_gpu(tmp_path):
    env = dict(os.environ, SPARKHVD_FAKE_GPU_DIR=str(tmp_path), PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "gpu_pinning_job.py"),
                           os.path.join(HERE, "scripts", "gpu_discovery.sh")],
                          capture_output=True, text=True, env=env, timeout=220)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run in json.loads(lines[0][len("RESULT "):]):
        views = {v["rank"]: v["cuda"] for v in run["values"]}
        assert sorted(views.values()) == ["0", "1"], run  # one distinct GPU per rank
        assert [[v] for _, v in sorted(views.items())] == run["gpus"]  # what Spark assigned
