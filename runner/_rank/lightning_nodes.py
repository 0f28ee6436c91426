"""Lightning's ``Trainer(devices=d, num_nodes=n)`` in a rank, whatever Spark's placement of the ranks on hosts.

Under torchrun's variables Lightning (its ``TorchElasticEnvironment``) takes ``LOCAL_RANK`` as the index of the
rank's device among the ``devices`` it was given, and ``GROUP_RANK`` as its node. HorovodRunner's variables describe
hosts (torchrun's layout, runner/_shared/framework_env.py): two ranks on one host have ``LOCAL_RANK`` 0 and 1. So
``Trainer(devices=1, num_nodes=np)``, the pattern Databricks documents, failed with Lightning's ``IndexError: list
index out of range`` whenever two ranks shared a host, and ``devices=<ranks per host>`` needed Spark's placement
known in advance (and an uneven one could not be written at all).

Where a Trainer's ``devices * num_nodes`` is the world size but its ``devices`` are not the layout's ranks per node,
the rank's variables become that Trainer's view when its launcher checks them (``validate_settings``, before
Lightning reads any of them): node ``RANK // devices``, local rank ``RANK % devices``, as torchrun would number ranks
on nodes of ``devices`` processes. Global ranks, the world size and the rendezvous do not change. The strategy's
device stays the rank's own GPU (the one ``hvd.init()`` would select: its placement's ``cuda_devices[0]``, or where
none is pinned, on the driver, ``LOCAL_RANK % device_count`` of the layout's own LOCAL_RANK), not entry ``LOCAL_RANK``
of the host's list. A product that is not the world size is left to Lightning's own
``ValueError``.

Installed in every rank (runner/_rank/worker.py); it imports nothing until the user's code imports Lightning.
"""

from __future__ import annotations

import os

from ..._common.topology import Placement
from .after_import import when_imported

#: Where ``TorchElasticEnvironment`` is defined: Lightning's unified package and the standalone ones.
ENVIRONMENTS = ("lightning.fabric.plugins.environments.torchelastic",
                "lightning_fabric.plugins.environments.torchelastic")
#: The strategies whose ``root_device`` is ``parallel_devices[local_rank]``: (module, class).
STRATEGIES = tuple((f"{package}.strategies.{module}", name)
                   for package in ("lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric")
                   for module, name in (("ddp", "DDPStrategy"), ("fsdp", "FSDPStrategy")))

_regrouped = False  # whether this rank's variables were made a Trainer's nodes (regroup)
_own_gpu: int | None = None  # the rank's own GPU among its CUDA_VISIBLE_DEVICES, where the runner pinned one
_local_rank: int | None = None  # LOCAL_RANK before regroup: where none is pinned, the GPU hvd.init() would take


def install(placement: Placement) -> None:
    """Regroup the rank's torchrun variables for the Trainers it builds, once Lightning is imported."""
    global _own_gpu
    _own_gpu = placement.cuda_devices[0] if placement.cuda_devices else None
    for module in ENVIRONMENTS:
        when_imported(module, _wrap_environment)
    for module, name in STRATEGIES:
        when_imported(module, lambda m, name=name: _wrap_root_device(getattr(m, name, None)))


def regroup(devices: int, nodes: int, environ=os.environ) -> bool:
    """Make ``environ``'s torchrun variables nodes of ``devices`` ranks where ``devices * nodes`` is the world size
    and the layout's nodes are not already that; whether it changed them."""
    try:
        rank, size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local_rank, local_size = int(environ["LOCAL_RANK"]), int(environ["LOCAL_WORLD_SIZE"])
        groups = int(environ.get("GROUP_WORLD_SIZE", "0"))
    except (KeyError, ValueError):
        return False
    if devices < 1 or devices * nodes != size:
        return False  # Lightning's validate_settings says so, with both numbers
    if local_size == devices and local_rank < devices and groups == nodes:
        return False
    global _local_rank
    if environ is os.environ:
        _local_rank = local_rank
    node = str(rank // devices)
    environ.update({"LOCAL_RANK": str(rank % devices), "LOCAL_WORLD_SIZE": str(devices), "GROUP_RANK": node,
                    "NODE_RANK": node, "GROUP_WORLD_SIZE": str(nodes)})
    return True


def _wrap_environment(module) -> None:
    cls = getattr(module, "TorchElasticEnvironment", None)
    if cls is None or getattr(cls.validate_settings, "_sparkhvd", False):
        return
    original = cls.validate_settings

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        global _regrouped
        if regroup(num_devices, num_nodes):
            _regrouped = True
        return original(self, num_devices, num_nodes)

    validate_settings._sparkhvd = True
    validate_settings.__doc__ = original.__doc__
    cls.validate_settings = validate_settings


def _wrap_root_device(cls) -> None:
    prop = getattr(cls, "root_device", None) if cls is not None else None
    if not isinstance(prop, property) or getattr(prop.fget, "_sparkhvd", False):
        return
    original = prop.fget

    def root_device(self):
        device = original(self)
        if _regrouped and device.type == "cuda":
            import torch

            if _own_gpu is not None:  # cuda:LOCAL_RANK would be another rank's GPU on this host
                return torch.device("cuda", _own_gpu)
            if _local_rank is not None:  # none pinned (on the driver, np<0): as hvd.init() selects one
                return torch.device("cuda", _local_rank % max(1, torch.cuda.device_count()))
        return device

    root_device._sparkhvd = True
    cls.root_device = property(root_device, prop.fset, prop.fdel, prop.__doc__)
