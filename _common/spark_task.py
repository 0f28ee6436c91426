"""The Spark task a rank runs for: what pyspark's ``TaskContext`` says of it, handed from the agent to the rank.

A rank is a process of its own that its task's agent starts (runner/_agent/agent.py), not the Spark task, so pyspark
has no context there. The agent reads its task's values (runner/_agent/task_context.py: ``read``) and gives them to
the rank in ``SPARKHVD_TASK_CONTEXT`` as this dataclass's JSON; the rank makes them pyspark's current context
(runner/_rank/task_context.py). Imports nothing of pyspark.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class SparkTask:
    """One Spark task's values, as pyspark's ``TaskContext`` methods of the same names return them."""

    stage_id: int
    partition_id: int
    attempt_number: int
    task_attempt_id: int
    cpus: int
    barrier: bool = True  # a barrier stage's task (BarrierTaskContext), as every sparkhvd stage is
    cpu_amount: str | None = None  # TaskContext.cpuAmount() (pyspark 4.3 on) as a Decimal's text; None: older pyspark
    #: resource name -> its addresses, as the rank sees them: "gpu" indexes the rank's CUDA_VISIBLE_DEVICES
    resources: dict = field(default_factory=dict)
    #: the job's local properties (``getLocalProperty``), among them "addresses", every task's executor, by partition
    local_properties: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "SparkTask":
        return cls(**json.loads(text))

    @property
    def addresses(self) -> list:
        """Every task's executor (``host:port``), by partition: what ``getTaskInfos()`` returns."""
        return [a.strip() for a in self.local_properties.get("addresses", "").split(",")]
