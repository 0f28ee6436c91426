"""The task agent: what runs in each Spark barrier task (or launcher thread) for one rank.

It registers with the driver (with its GPUs, mapped through its executor's own
``CUDA_VISIBLE_DEVICES``), receives its rank and this job's GPUs on its host, starts the rank's
own Python process with those GPUs in its environment (a fresh process, so the list holds before
any CUDA work even when Spark reuses its Python workers), forwards that process's stdout and stderr
to the driver in batches of lines, and reports its exit code. The secret reaches the rank process on
its stdin, never on a command line or in the environment.

Its parts: ``runner/_agent/spec.py`` (what it is given), ``runner/_agent/env.py`` (the rank's environment),
``runner/_agent/process.py`` (starting and killing the rank's process), ``runner/_agent/output.py``
(forwarding its output).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import threading
import time
from typing import Callable

from ..._common import driver_messages as dm
from ..._common import settings
from ..._common.client import RunAborted, ServiceClient, ServiceError
from ..._common.network import local_address
from .._shared.framework_env import Endpoint, reserve_ports
from .._shared.host import address_of, host_id
from .env import rank_env, visible_gpus
from .output import forward_output
from .process import kill_group, start_rank
from .spec import TaskSpec
from .task_context import read as read_task

#: After the rank's process group is gone its pipes close, and its pumps forward what is left however long that
#: takes. A pipe that stays open has a writer outside the group (a process the rank started in a session of its
#: own): once it has had nothing to read for this long, its pump is left to forward what comes later.
PUMP_QUIET_S = 5.0
PUMP_MAX_S = 300.0  # and a pump still forwarding this long after the rank exited is left (a driver that stopped reading)


def run_task(spec: TaskSpec, task: int, *, host: str | None = None, gpus: list[str] | None = None,
             on_spawn: Callable[[subprocess.Popen], None] | None = None, spark_task: tuple | None = None,
             env: dict | None = None) -> dict:
    """Run rank ``task``'s process to the end; returns a small status row. ``spark_task``: ``(stage id, task id)``
    of the Spark task it runs in, by which the driver finds its executor in Spark's status store; given, the rank also
    gets that task's pyspark ``TaskContext`` (runner/_agent/task_context.py). ``env``: variables of this task's own
    for the rank (where its partition's rows are: TorchDistributor._train_on_dataframe).

    Never raises for the user's failure: that reaches the driver through the service, so a
    Spark barrier stage never retries a training run on its own.
    """
    client = ServiceClient(spec.address, spec.secret)
    if task in spec.stall_tasks:  # fault tests: never register; leave when the run is aborted
        try:
            client.ask(dm.Watch(-1))
        except (RunAborted, ServiceError, OSError, ConnectionError):
            pass
        client.close()
        return {"task": task, "rank": None, "exit": None, "note": "stalled on purpose"}
    host = host or socket.gethostname()
    if not spec.use_gpu:  # Spark may still give the task GPUs (spark.task.resource.gpu.amount): its rank sees none
        gpus = []
    try:  # mapped here, through this executor's own list: another executor on the host may have another
        devices, unusable = visible_gpus(list(gpus or []), settings.CUDA_VISIBLE_DEVICES.get()), None
    except ValueError as exc:
        devices, unusable = [], exc
    endpoint, held = _endpoint(spec)
    try:
        answer = dm.decode(dm.Assign, client.ask(dm.Register(
            task=task, host=host, host_id=host_id(), pid=os.getpid(), gpus=[str(g) for g in gpus or []],
            devices=devices, spark_task=None if spark_task is None else list(spark_task), endpoint=endpoint)).meta)
    except (RunAborted, ServiceError) as exc:
        client.close()
        return {"task": task, "rank": None, "exit": None, "note": str(exc)}
    finally:
        for sock in held:  # every task has registered: the ports stay free until the rank binds them
            sock.close()
    host_gpus = answer.host_gpus
    endpoints = [None if e is None else Endpoint(*e) for e in answer.endpoints]
    node = tuple(answer.node)
    placement = answer.placement  # exactly a Placement's fields: the rank process reads it back as one
    rank = placement["rank"]
    try:
        if unusable is not None:
            raise unusable
        rank_variables = rank_env(spec, placement, host_gpus, endpoints=endpoints, node=node,
                                  task=read_task() if spark_task is not None else None)
        rank_variables.update(env or {})
    except ValueError as exc:  # the executor's GPU settings: the rank's error, not a Spark task failure
        _report(client, dm.Error(rank=rank, type="ValueError", message=str(exc)))
        _report(client, dm.Exit(rank=rank, code=1))
        client.close()
        return {"task": task, "rank": rank, "exit": 1, "note": str(exc)}
    code = _run_rank(client, spec, rank, rank_variables, on_spawn)
    _report(client, dm.Exit(rank=rank, code=code))
    client.close()
    return {"task": task, "rank": rank, "exit": code, "note": ""}


def run_tasks(spec: TaskSpec, tasks: list, *, spark_task: tuple | None = None, env: dict | None = None) -> list:
    """Run the agents of ``tasks`` (``(task index, its GPUs)``) side by side in this Spark task's Python worker;
    their status rows, once every one has ended. An agent that raised (sparkhvd's own fault: the user's failures
    reach the driver through the service) re-raises here at once, failing the Spark task as a one-agent task would:
    the barrier stage ends, and the driver stops the others' ranks."""
    rows: list = [None] * len(tasks)
    errors: list = []

    def agent(i: int, task: int, gpus: list) -> None:
        try:
            rows[i] = run_task(spec, task, gpus=gpus, spark_task=spark_task, env=env)
        except BaseException as exc:  # noqa: BLE001 - raised in the task's own thread below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i, task, gpus), name=f"sparkhvd-agent-{task}", daemon=True)
               for i, (task, gpus) in enumerate(tasks)]
    for thread in threads:
        thread.start()
    while True:
        alive = [thread for thread in threads if thread.is_alive()]
        if errors:
            raise errors[0]
        if not alive:
            return rows
        alive[0].join(0.1)


def _endpoint(spec: TaskSpec) -> tuple[list | None, list]:
    """This host's address toward its peers and two ports reserved on it (runner/_shared/framework_env.py), and the
    sockets holding them until registration is over; None where the address cannot be told (the rank process then
    reports why, runner/_shared/host.py: rank_address)."""
    try:
        address = address_of(spec.network_interface) if spec.network_interface else local_address(spec.address[0])
        endpoint, held = reserve_ports(address)
    except (OSError, ValueError):
        return None, []
    return [endpoint.address, endpoint.torch_port, endpoint.tf_port], held


def _run_rank(client: ServiceClient, spec: TaskSpec, rank: int, env: dict,
              on_spawn: Callable[[subprocess.Popen], None] | None) -> int:
    """Start the rank's process, hand it the secret, forward its output until it exits; its exit code."""
    proc = start_rank(spec.python, env, rank, preload=spec.warm_preload)
    if on_spawn is not None:
        on_spawn(proc)
    proc.stdin.write(spec.secret)
    proc.stdin.close()
    pipes = [(name, pipe, os.dup(pipe.fileno())) for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    pumps = [threading.Thread(target=forward_output, args=(client, rank, name, pipe), daemon=True)
             for name, pipe, _ in pipes]
    for pump in pumps:
        pump.start()
    try:
        code = proc.wait()
    finally:  # whatever the rank started and left running goes with it; or the Spark task was killed: all of it
        kill_group(proc)
    try:
        for pump, (_, _, fd) in zip(pumps, pipes):
            drain(pump, fd)
    finally:
        for _, _, fd in pipes:
            os.close(fd)
    return code


def drain(pump: threading.Thread, fd: int, quiet_s: float = PUMP_QUIET_S, most_s: float = PUMP_MAX_S) -> bool:
    """Wait until ``pump`` has forwarded its pipe to the end; ``fd``: the agent's own descriptor of that pipe (a
    ``dup``, so it stays valid when the pump closes its copy). Returns False if it gave up: the pipe stayed open with
    nothing to read for ``quiet_s`` (a writer outside the rank's group holds it; the pump has read and sent all
    there was), or the pump was still sending after ``most_s``. A pump that is behind, on a loaded machine, is waited
    for as long as its pipe has data or its end has not been read."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    started = quiet_since = time.monotonic()
    while pump.is_alive():
        now = time.monotonic()
        if poller.poll(0):  # data not yet read, or the writers gone (the pump reads the end, then stops)
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            return False
        if now - started >= most_s:
            return False
        pump.join(0.05)
    return True


def _report(client: ServiceClient, report) -> None:
    try:
        client.ask(report)
    except (OSError, ConnectionError, RunAborted, ServiceError):
        pass  # the driver has gone or has finished; nothing left to tell it
