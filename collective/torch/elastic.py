"""``hvd.elastic`` for torch: ``TorchState``, ``ElasticSampler`` and ``run``, as Horovod's ``horovod.torch.elastic``.

A commit is kept in this process's memory and, inside a HorovodRunner run, off the ranks too
(see ``collective/_core/_elastic.py``).
"""

from __future__ import annotations

import copy
import math
import random
import sys

import torch

from ..._common import commits as _commits
from .._core import broadcast_object, rank, size
from .._core._elastic import HostsUpdatedInterrupt, HostUpdateResult, ObjectState, State, run
from . import _sharded
from ._functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState", "ElasticSampler", "ObjectState", "State", "HostsUpdatedInterrupt", "HostUpdateResult",
           "StateHandler", "get_handler_registry", "set_handler_registry", "run"]


class ElasticSampler(torch.utils.data.Sampler):
    """Cuts a dataset among the ranks, and again after a reset, skipping what this epoch already processed.

    As Horovod's: put it in the ``TorchState``, call ``record_batch(batch_idx, batch_size)`` after each
    batch and ``set_epoch(epoch)`` at the end of each epoch. ``seed`` must be the same on every rank.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0  # samples processed this epoch by all ranks together
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (call it at the end of the previous one): nothing of it is processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Each rank processed ``batch_size`` more samples."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        self.num_replicas = size()
        self.rank = rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:  # the same order on every rank
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        pad = self.total_size - len(indices)  # repeated to divide evenly, as DistributedSampler: every rank gets
        if pad and indices:                    # num_samples, so all run the same number of batches
            indices += (indices * math.ceil(pad / len(indices)))[:pad]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class TorchState(ObjectState):
    """A torch training's state: models, optimizers and ElasticSamplers (any keyword), and plain values.

    ``TorchState(model=model, optimizer=opt, epoch=0, batch=0)``: each keyword is an attribute;
    modules, optimizers and samplers are saved through their ``state_dict()``, the rest as values.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, values = {}, {}
        sharded = _sharded.sharded_handlers(kwargs)  # FSDP2 modules and their optimizers: each rank keeps its shard
        for name, value in kwargs.items():
            handler = sharded.get(name) or _handler(value)
            if handler is not None:
                handlers[name] = handler
            else:
                values[name] = value
        self._handlers = handlers
        self._sharded = list(sharded)
        self._shards = _sharded.ShardWriter()
        self._deepspeed = any(isinstance(h, _sharded.DeepSpeedHandler) for h in sharded.values())
        self._shard_token = None
        self._loading = False
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **values)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for name, handler in self._handlers.items():
            if not (self._loading and name in self._sharded):  # rank 0 alone loads a snapshot: no collective here
                handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def _snapshot(self) -> dict:
        return dict(super()._snapshot(), handlers={name: h._saved for name, h in self._handlers.items()
                                                   if name not in self._sharded})

    def _load(self, snapshot: dict) -> None:
        for name, handler in self._handlers.items():
            if name not in self._sharded:
                handler._saved = snapshot["handlers"][name]
        self._loading = True  # the sharded parts were loaded by every rank (_read_shards)
        try:
            super()._load(snapshot)
        finally:
            self._loading = False

    def _send(self, meta: dict) -> None:
        if not self._sharded:
            return super()._send(meta)
        if not self._resumed:  # before hvd.elastic.run: every rank's restore must see the previous attempt's commit
            return
        if self._deepspeed:
            if self._shard_token is None:
                self._shard_token = _sharded.new_token()
            shards = _sharded.write_deepspeed(self._key, self._seq, self._shard_token,
                                              {name: self._handlers[name] for name in self._sharded})
            if shards is not None and self._rank() == 0:
                _commits.publish(dict(meta, shards=shards), self._snapshot(), self.on_hosts_updated)
            return
        snapshot = self._snapshot() if self._rank() == 0 else None  # the plain values as save() kept them

        def publish(shards: dict) -> None:
            _commits.publish(dict(meta, shards=shards), snapshot, self.on_hosts_updated)

        self._shards.start(self._key, self._seq, {name: self._handlers[name]._saved for name in self._sharded},
                           publish)

    def _settle(self) -> None:
        self._shards.wait()

    def _read_shards(self, meta: dict) -> None:
        handlers = {name: self._handlers[name] for name in self._sharded}
        if self._deepspeed:
            return _sharded.read_deepspeed(meta["shards"], handlers, int(meta["size"]))
        _sharded.read(meta["shards"], handlers)

    def __setattr__(self, name, value):
        if name in getattr(self, "_handlers", ()) and hasattr(self, name):
            self._handlers[name].set_value(value)  # a new model or optimizer: saved as it is now
        super().__setattr__(name, value)


class StateHandler:
    """How one kind of value is saved, restored and synced (Horovod's); register more with ``set_handler_registry``."""

    def __init__(self, value):
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # a copy: an optimizer's load_state_dict keeps the tensors it is given, which its next step would change
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_handler_registry = [(torch.nn.Module, ModelStateHandler), (torch.optim.Optimizer, OptimizerStateHandler),
                     (ElasticSampler, SamplerStateHandler)]


def get_handler_registry() -> list:
    """The (type, StateHandler class) pairs TorchState tries in order."""
    return _handler_registry


def set_handler_registry(registry: list) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler(value):
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


sys.modules[__name__ + ".state"] = sys.modules[__name__]  # Horovod's paths: horovod.torch.elastic.state, .sampler
sys.modules[__name__ + ".sampler"] = sys.modules[__name__]
