"""PyTorch's DDP tutorial ending in a rank: ``dist.destroy_process_group()`` with the DDP model alive, then return.

Freeing the model then ran ``~ProcessGroupGloo`` under the GIL, which could deadlock with a gloo thread waiting
for the GIL (docs/performance.md); a rank keeps the groups it destroys (runner/_rank/process_groups.py) and ends
with ``os._exit``. The loop runs through the real runner on a busy machine; without the fix the test failed (a run
hung) in 10 of 10 tries as a function and 6 of 10 as a script (2026-12-02, 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from _load import cpu_hogs

RUNS = 8
RUN_TIMEOUT_S = 30.0  # a warm run takes about a second; the heartbeat would give up at 60 s
FIRST_TIMEOUT_S = 180.0  # the first run may start the session's warm process
STEPS, LR = 20, 0.01

BODY = textwrap.dedent(f"""\
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr={LR})
    x = (torch.arange(6.0) + 1 + 6 * rank).reshape(1, 6)
    for _ in range({STEPS}):
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
    weights = model.weight.detach().flatten().tolist() + model.bias.detach().tolist()
    dist.destroy_process_group()  # the tutorial's cleanup(), the DDP model still alive
""")

SCRIPT = BODY + 'print("WEIGHTS", rank, __import__("json").dumps(weights), flush=True)\n'

DRIVER = ("import json, sys\n"
          "from sparkhvd import HorovodRunner\n\n"
          "def train():\n" + textwrap.indent(BODY, "    ") + "    return weights\n\n"
          "if sys.argv[1] == 'function':\n"
          "    print('RESULT', json.dumps(HorovodRunner(np=-2).run(train)), flush=True)\n"
          "else:\n"
          "    HorovodRunner(np=-2).run('train.py')\n")


def _expected() -> list:
    """The weights after ``STEPS`` steps of the ranks' averaged gradient (d/dW = x, d/db = 1): every rank's."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    mean_x = torch.arange(6.0) + 1 + 3
    return (model.weight.detach().flatten() - STEPS * LR * mean_x).tolist() + \
           (model.bias.detach() - STEPS * LR).tolist()


def _run(folder, mode: str, timeout: float) -> str:
    """One driver process running the two ranks; its output, or a failure naming the hang."""
    proc = subprocess.Popen([sys.executable, "drive.py", mode], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, SPARKHVD_WARM="1"))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agents go, and with them their ranks (the warm process kills them)
        out, _ = proc.communicate()
        pytest.fail(f"a {mode} run hung: no result within {timeout:.0f} s; its output:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _weights(out: str) -> dict:
    """rank -> weights, from a function's result (rank 0) or a script's lines (every rank)."""
    found = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            found[0] = json.loads(line[len("RESULT "):])
        elif "WEIGHTS " in line:
            rank, weights = line.split("WEIGHTS ", 1)[1].split(" ", 1)
            found[int(rank)] = json.loads(weights)
    return found


@pytest.mark.timeout(FIRST_TIMEOUT_S + RUNS * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("mode", ["function", "script"])
def test_the_ddp_tutorials_ending_returns_every_run_on_a_busy_machine(tmp_path, mode):
    (tmp_path / "drive.py").write_text(DRIVER)
    (tmp_path / "train.py").write_text(SCRIPT)
    expected = _expected()
    ranks = [0] if mode == "function" else [0, 1]

    def check(i: int, timeout: float) -> None:
        weights = _weights(_run(tmp_path, mode, timeout))
        assert sorted(weights) == ranks, weights
        for rank in ranks:
            assert weights[rank] == pytest.approx(expected, rel=1e-5, abs=1e-6), (i, rank)

    check(0, FIRST_TIMEOUT_S)  # brings the session's warm process up, before the machine is made busy
    with cpu_hogs(2):  # the hang needed a busy machine to show
        for i in range(1, RUNS + 1):
            check(i, RUN_TIMEOUT_S)


KEEPS = textwrap.dedent("""
    import json, os, sys
    from sparkhvd.runner._rank import process_groups, startup

    startup.prepare()
    imported_before = "torch" in sys.modules
    import torch
    import torch.distributed as dist
    from torch.distributed import destroy_process_group  # as PyTorch's tutorial imports it

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    seen = []
    for port in (sys.argv[1], sys.argv[2]):  # destroy, then build the default group again
        os.environ["MASTER_PORT"] = port
        dist.init_process_group("gloo")
        sub = dist.new_group([0])
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        ddp(torch.ones(1, 2)).sum().backward()
        destroy_process_group()
        seen.append({"initialized": dist.is_initialized(), "kept": len(process_groups.kept)})
        del ddp, sub
    print(json.dumps({"torch_before": imported_before, "runs": seen,
                      "same": dist.destroy_process_group is destroy_process_group
                              is dist.distributed_c10d.destroy_process_group,
                      "name": destroy_process_group.__name__}))
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.timeout(120)
def test_a_rank_keeps_the_groups_it_destroys_and_imports_torch_only_when_the_user_does():
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    done = subprocess.run([sys.executable, "-c", KEEPS, *ports], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "torch_before": False, "same": True, "name": "destroy_process_group",
        # the default group and the subgroup each time, kept; torch's registry is empty after each destroy
        "runs": [{"initialized": False, "kept": 2}, {"initialized": False, "kept": 4}]}
