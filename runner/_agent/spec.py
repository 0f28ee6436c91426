"""What a task agent needs to join a run: the driver's address and secret, the run, and its options.

Made on the driver (``HorovodRunner``) and carried to each task inside the Spark closure, or handed to
the local launcher's agent threads; read by ``runner/_agent/agent.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs to join a run; travels inside the Spark closure."""

    address: tuple[str, int]
    secret: bytes = field(repr=False)
    run_id: str
    python: str | None = None  # the rank process's interpreter; default: this one
    stall_tasks: frozenset = frozenset()  # fault tests: these task indices never register
    network_interface: str | None = None  # the interface ranks talk on; default: the one toward the driver
    every_value: bool = True  # False: only rank 0 ships its return value (HorovodRunner.run)
    attempt: int = 0  # 0, then 1, 2, ... for each restart (HorovodRunner(max_restarts=))
    commit_dir: str | None = None  # where rank 0 writes elastic commits (_common/commits.py); default: the driver
    layout: str = "torchrun"  # torchrun's variables: "torchrun" or "node_per_task" (runner/_shared/framework_env.py)
    max_restarts: int = 0  # the run's, which ranks see as TORCHELASTIC_MAX_RESTARTS
    use_gpu: bool = True  # False: the task asks for no GPU and its rank sees none, whatever Spark gives it
    env: tuple = field(default=(), repr=False)  # (name, value) pairs added to the rank's environment (MLflow)
    warm_preload: tuple = ()  # ("tensorflow",): fork the ranks from a warm process that imported it too
    per_task: int = 1  # ranks in each Spark task, one per GPU it holds (runner/_backends/spark.py: ranks_per_task)
