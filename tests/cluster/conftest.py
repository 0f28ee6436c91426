"""The ``cluster`` fixture: 2 namespace hosts running a Spark standalone cluster, shared by tests/cluster.

Package-scoped: built once for every test in tests/cluster (they run first in the suite, which
collects ``cluster/`` before ``test_*.py``) and torn down after the last of them, so its JVMs
do not sit on the machine's memory and cores through the rest of the suite.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2) or Java is
missing. Torn down after the last cluster test, on Ctrl-C, SIGTERM or SIGHUP, and at interpreter
exit; the JVMs and the driver die with the pytest process (PR_SET_PDEATHSIG) even when it is
SIGKILLed, and the next session sweeps what such a session leaves (namespaces, links, folders).
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading

import pytest

from ._cluster import Cluster
from ._netns import TestbedError, unavailable_reason

HOSTS = 2
#: Host B's executors have their own CUDA_VISIBLE_DEVICES (as under a container runtime that
#: exposes GPUs 6 and 7): Spark's addresses "0", "1" there index this list. Host A has none.
HOST_B_VISIBLE_DEVICES = "6,7"


#: Short stall and heartbeat settings, as the issue asks of fault tests (the defaults are 60 s): in
#: the executors' environment, where a user would set them; the ranks forward them to the driver.
FAULT_SETTINGS = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "4", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "12",
                  "SPARKHVD_HEARTBEAT_SECONDS": "1", "SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS": "8"}


def _interrupt(signum, frame):  # SIGTERM/SIGHUP: unwind like Ctrl-C, so fixtures tear down
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="package")
def cluster():
    """A started ``Cluster`` (see ``_cluster.py``): ``cluster.driver.run(job, np)`` runs a job on it."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no cluster testbed here: {reason}")
    # 3 cores a worker: the driver's executor takes 2 (and both GPUs), which leaves one for a second application's
    # executor beside it (test_cluster_connect.py's Spark Connect server) without stopping the driver
    testbed = Cluster(HOSTS, cores=3, python=sys.executable,
                      host_env={1: {"CUDA_VISIBLE_DEVICES": HOST_B_VISIBLE_DEVICES}})
    atexit.register(testbed.close)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                previous[sig] = signal.signal(sig, _interrupt)
    try:
        try:
            testbed.start(executor_env=FAULT_SETTINGS)
        except TestbedError as exc:
            problems = testbed.close()
            pytest.fail(f"the cluster testbed did not start: {exc}"
                        + (f"\ncleanup problems: {problems}" if problems else ""), pytrace=False)
        print(f"\n[cluster] {HOSTS} hosts, master {testbed.master_url}, "
              f"{testbed.driver.ready['slots']} task slots; started in {testbed.start_seconds:.1f} s "
              f"({', '.join(f'{k} up at {v:.1f} s' for k, v in testbed.start_phases.items())})", flush=True)
        yield testbed
    finally:
        problems = testbed.close()
        atexit.unregister(testbed.close)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if problems:
            print(f"[cluster] cleanup problems: {problems}", file=sys.stderr)


@pytest.fixture
def no_leftover_ranks(cluster):
    """After the test: no rank process is left on any host."""
    yield
    left = cluster.wait_no_ranks()
    assert not left, f"rank processes left running: {left}"
