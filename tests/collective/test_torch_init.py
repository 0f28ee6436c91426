"""hvd.init outside HorovodRunner: a job of one in a plain process, a clear error before init, and a rank of a
torchrun job."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def test_init_outside_the_runner_is_a_job_of_one():
    code = textwrap.dedent("""
        import torch, sparkhvd.collective.torch as hvd
        hvd.init()
        print(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.allreduce(torch.tensor([3.0])).item())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["0", "1", "0", "3.0"], out.stderr


def test_init_before_anything_is_a_clear_error():
    code = "import sparkhvd.collective.torch as hvd\ntry:\n    hvd.rank()\nexcept ValueError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "sparkhvd has not been initialized; call hvd.init() first."


@pytest.mark.timeout(180)
def test_init_joins_a_torchrun_job(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, sparkhvd.collective.torch as hvd
        hvd.init()
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
        print(f"RESULT {hvd.rank()} {hvd.size()} {hvd.local_rank()} {hvd.local_size()} {total.item()}")
    """))
    import socket

    with socket.socket() as s:  # torchrun needs a concrete port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             "--master-addr=127.0.0.1", f"--master-port={port}", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:  # leave no torchrun worker behind
            os.killpg(proc.pid, 9)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    import re

    results = sorted(re.findall(r"RESULT \d \d \d \d [\d.]+", out.stdout))  # ranks share one pipe
    assert results == ["RESULT 0 2 0 2 3.0", "RESULT 1 2 1 2 3.0"], out.stdout + out.stderr
