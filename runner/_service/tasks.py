"""The driver service's tasks: each registers, and once all have, the ranks are assigned; then each
fetches the pickled function and watches for the run's abort.

Part of ``DriverService`` (``_service/service.py``), whose state and lock these handlers use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..._common.driver_messages import Aborted, Assign, Fetch, Register, Watch, encode
from ..._common.protocol import AuthenticatedChannel, Kind
from ..._common.topology import assign_ranks, host_gpus
from .._shared.framework_env import Endpoint, node_of


@dataclass
class Registration:
    """What a task told the driver about itself."""

    task: int
    host: str  # the hostname, for messages
    pid: int
    gpus: list  # Spark's GPU addresses for the task
    peer: str  # the address the driver saw the task's connection come from
    host_id: str = ""  # what groups ranks by host (runner/_shared/host.py); the hostname where absent
    devices: list = field(default_factory=list)  # its GPUs as the host names them: ``gpus`` mapped by the agent
    spark_task: tuple | None = None  # (stage id, task id) of its Spark task, which Spark's status store knows
    endpoint: Endpoint | None = None  # its host's address and the ports it reserved for the frameworks' servers


class TaskHandlers:
    """REGISTER, FETCH and WATCH. Uses ``DriverService``'s ``cv``, ``np``, ``registrations``, ``placements``,
    ``gpu_lists``, ``placed_at``, ``milestones``, ``_agents``, ``aborted`` and ``_payload``."""

    def _register(self, channel: AuthenticatedChannel, register: Register, blob: bytes, peer: str) -> None:
        task = register.task
        refusal = None
        with self.cv:
            if not 0 <= task < self.np:
                refusal = f"task index {task!r} is outside 0..{self.np - 1}"
            elif task in self.registrations:
                refusal = f"task {task} registered twice; a retried Spark task cannot join a run that has started"
            else:
                self._add_registration(register, peer)
                self._agents[channel.sock] = task  # the agent reports its rank's exit on this connection
        if refusal is not None:
            return self._refuse(channel, refusal)  # never send while holding cv
        if not self._wait(lambda: self.placements is not None, None):
            return self._abort_reply(channel)
        # The placement (what the rank process reads back as a Placement), and beside it the task's GPU list, every
        # rank's endpoint and the task's host index (runner/_shared/framework_env.py: torchrun's variables, TF_CONFIG).
        channel.send(Kind.ASSIGN, encode(Assign(placement=self.placements[task].as_dict(),
                                                host_gpus=self.gpu_lists[task], endpoints=self.endpoints,
                                                node=list(node_of(self.placements, task)))))

    def _add_registration(self, register: Register, peer: str) -> None:
        """Record a task (cv held); once all have registered, assign the ranks."""
        self.milestones.setdefault("registered", time.monotonic())
        task = register.task
        self.registrations[task] = Registration(
            task=task, host=register.host, pid=register.pid, gpus=list(register.gpus), peer=peer,
            host_id=register.host_id or register.host, devices=list(register.devices),
            spark_task=_spark_task(register.spark_task), endpoint=Endpoint.parse(register.endpoint))
        if len(self.registrations) == self.np:
            hosts = [self.registrations[t].host_id for t in range(self.np)]
            self.placements, self.gpu_lists = host_gpus(assign_ranks(hosts), hosts,
                                                        [self.registrations[t].devices for t in range(self.np)])
            by_rank = sorted(range(self.np), key=lambda t: self.placements[t].rank)
            self.endpoints = [None if (e := self.registrations[t].endpoint) is None else [e.address, e.torch_port,
                                                                                          e.tf_port] for t in by_rank]
            self.placed_at = self.milestones["placed"] = time.monotonic()
        self.cv.notify_all()

    def _fetch(self, channel: AuthenticatedChannel, fetch: Fetch, blob: bytes, peer: str) -> None:
        with self.cv:
            self._fetches += 1
            if self._fetches == self.np:
                self.milestones["fetched"] = time.monotonic()
        channel.send(Kind.OK, {}, self._payload)

    def _watch(self, channel: AuthenticatedChannel, watch: Watch, blob: bytes, peer: str) -> None:
        with self.cv:
            while not self._over():
                self.cv.wait()
            aborted = self.aborted
        if aborted is not None:
            channel.send(Kind.ABORT, encode(Aborted(aborted)))


def _spark_task(value) -> tuple | None:
    """A REGISTER frame's ``spark_task``: ``(stage id, task id)``, or None where absent or malformed."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
        return tuple(value)
    return None
