"""The engine: Horovod's background engine over torch.distributed, below the framework-neutral core.

``communicator`` joins the job (``hvd.init()``) and starts the ``engine`` thread, which matches ops
across ranks by name (``negotiate``) over authenticated control links (``mesh``, ``channel``),
fuses them, and runs them on gloo or NCCL; ``timeline`` records what it did. It imports nothing
from ``collective/_core`` or the framework APIs above it (docs/layout.md).
"""
