"""``hvd.init()`` for TensorFlow: the core's init, then only the rank's own GPU visible to TensorFlow.

The runner lists every GPU of this job on a rank's host in its ``CUDA_VISIBLE_DEVICES`` (so Horovod's
``tf.config.set_visible_devices(gpus[hvd.local_rank()], 'GPU')`` selects the rank's own), and
TensorFlow takes memory on every GPU it can see. So ``init()`` narrows TensorFlow to the rank's own
GPU(s), while it still may: before TensorFlow has initialised its devices, and where the script has
not chosen its visible GPUs itself. The idiom after ``init()`` still works: the physical device list
is unchanged, and setting the same visible list again is allowed at any time.
"""

from __future__ import annotations

import tensorflow as tf

from .._core import init as _core_init
from .._engine import communicator as _engine


def init(comm=None, process_sets=None) -> None:
    """Join this process's job (as ``sparkhvd.collective.torch.init``), and show TensorFlow only this rank's GPU."""
    _core_init(comm, process_sets)
    show_own_gpus(tf.config, _engine.topology())


def own_gpus(physical: list, topology) -> list:
    """This rank's GPUs among TensorFlow's ``physical`` ones: entries ``topology.cuda_devices`` of the
    runner's list, or, where it pinned none (np<0), the ``local_rank``-th modulo their number."""
    if not physical:
        return []
    indices = topology.cuda_devices or (topology.local_rank % len(physical),)
    return [physical[i] for i in indices if i < len(physical)]


def show_own_gpus(config, topology) -> bool:
    """Make only this rank's GPUs visible through ``config`` (``tf.config``); True if it did.

    Does nothing where the script has already narrowed the visible GPUs, or where TensorFlow has
    initialised its devices ("Visible devices cannot be modified after being initialized").
    """
    physical = config.list_physical_devices("GPU")
    own = own_gpus(physical, topology)
    if not own or own == physical or config.get_visible_devices("GPU") != physical:
        return False
    try:
        config.set_visible_devices(own, "GPU")
    except RuntimeError:  # TensorFlow already uses every GPU it sees; nothing can change that now
        return False
    return True
