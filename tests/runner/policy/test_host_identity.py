"""Host identity, GPU address mapping and the failure headline's rules (pure logic, real processes)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from sparkhvd.runner._agent.agent import visible_gpus
from sparkhvd.runner._shared.host import host_id


@pytest.mark.unit
def test_spark_gpu_addresses_index_an_existing_cuda_visible_devices():
    assert visible_gpus(["0", "1"], None) == ["0", "1"]
    assert visible_gpus(["1"], "4,5,6") == ["5"]
    assert visible_gpus([0, 2], " 4, 5 ,6") == ["4", "6"]
    with pytest.raises(ValueError, match=r"Spark gave this task GPU address 3, but the executor's "
                                         r"CUDA_VISIBLE_DEVICES='4,5' lists only 2 devices; make the discovery "
                                         r"script print indices into that list \(0..1\)"):
        visible_gpus(["3"], "4,5")
    with pytest.raises(ValueError, match=r"Spark gave this task the GPU addresses \['GPU-a1'\], which cannot "
                                         r"index the executor's CUDA_VISIBLE_DEVICES='0'"):
        visible_gpus(["GPU-a1"], "0")


def test_host_identity_is_more_than_the_hostname():
    import socket

    here = host_id()
    assert here.startswith(socket.gethostname() + "-") and here == host_id()
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    code = "from sparkhvd.runner._shared.host import host_id; print(host_id())"
    proc = subprocess.run(["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {proc.stderr.strip()[-200:]}")
    other = proc.stdout.strip()
    assert other.split("-")[0] == here.split("-")[0]  # the same hostname...
    assert other != here  # ...but another network namespace: another host


def test_a_failure_with_only_collateral_errors_names_the_silent_ranks(tmp_path):
    """What the driver says when ranks vanish without a word (an executor or host lost)."""
    from sparkhvd._common.topology import assign_ranks
    from sparkhvd.runner._backends.local import LocalLauncher
    from sparkhvd.runner._policy.failure_report import explained
    from sparkhvd.runner._policy.failure_report import failure_error as _failure_error
    from sparkhvd.runner._service.logs import LogRouter
    from sparkhvd.runner._service.service import DriverService, Failure, Registration

    service = DriverService(np=4, secret=b"k" * 32, payload=b"")
    logs = LogRouter(str(tmp_path), "all")
    try:
        hosts = ["a-1", "a-1", "b-2", "b-2"]
        for task, host in enumerate(hosts):
            service.registrations[task] = Registration(task=task, host=host[0], pid=1, gpus=[],
                                                       peer=f"198.18.0.{2 + task // 2}", host_id=host)
        service.placements = assign_ranks(hosts)
        collateral = [Failure(rank=r, type="MeshError", message="rank 3 closed its control link during allreduce: "
                                                                "it has exited or failed", traceback="tb")
                      for r in (0, 1)]
        assert not explained(collateral, {}, None, None)
        from sparkhvd.runner._policy.failure_report import is_collateral

        assert not is_collateral(Failure(0, "ConnectionRefusedError", "[Errno 111] Connection refused", ""))
        assert is_collateral(Failure(0, "RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                                                        "error [127.0.0.1]:1234: Connection reset by peer", ""))
        # inside model.fit TensorFlow wraps it; a user's own TensorFlow error stays a cause
        assert is_collateral(Failure(0, "UnknownError", "Graph execution error: ... MeshError: grouped_allreduce "
                                                        "failed: rank 1's control link failed", ""))
        assert not is_collateral(Failure(0, "UnknownError", "Graph execution error: ... ValueError: bad shape", ""))
        text = str(_failure_error(service, logs, collateral, {}, None, None, "r1", LocalLauncher(4)))
        assert text.startswith("HorovodRunner run r1 failed: ranks 2,3 stopped without a word: no error, no exit "
                               "code and no result reached the driver, so their process, executor or host was lost")
        assert "then, as a consequence, ranks 0,1: MeshError: rank 3 closed its control link" in text
        lost = "ranks 2,3 ran on executor 1 on host b (198.18.0.3), which Spark lost: Command exited with code 137"
        assert explained(collateral, {}, None, lost)
        text = str(_failure_error(service, logs, collateral, {}, None, lost, "r1", LocalLauncher(4)))
        assert text.startswith(f"HorovodRunner run r1 failed: {lost}\nthen, as a consequence, ranks 0,1:")
        cause = Failure(rank=2, type="ValueError", message="bad label", traceback="tb2")
        text = str(_failure_error(service, logs, collateral + [cause], {3: -9}, None, None, "r1", LocalLauncher(4)))
        lines = text.splitlines()
        assert lines[0] == "HorovodRunner run r1 failed: rank 2: ValueError: bad label"
        assert lines[1] == "rank 3's process on host b (198.18.0.3) was killed by signal 9 before returning a " \
                           "result; it printed nothing"
        assert lines[2].startswith("then, as a consequence, ranks 0,1: MeshError")
    finally:
        service.close()
        logs.close()
