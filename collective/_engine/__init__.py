"""The engine: Horovod's background engine over torch.distributed, below the framework-neutral core.

``communicator`` joins the job (``hvd.init()``) and starts the ``engine`` thread. The core describes
each collective as an ``ops.Op`` and holds an ``ops.Handle``; the engine sends each op's
``messages.Request`` to its set's coordinator (``coordinator``, deciding with ``negotiate``), which
answers with ``messages.Answer``s over authenticated control links (``mesh``, ``channel``); ``pair``
(sets of two), ``fusion`` and ``join`` are the engine's special paths, and ``timeline`` records what
it did. It imports nothing from ``collective/_core`` or the framework APIs above it (docs/layout.md).
"""
