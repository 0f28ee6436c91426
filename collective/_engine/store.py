"""The ranks' side of the rendezvous store (``_common/rendezvous.py``, served by the driver service), as a c10d Store."""

from __future__ import annotations

import torch.distributed as dist

from ..._common import driver_messages as dm
from ..._common.client import ServiceClient


class DriverStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in the run's ``RendezvousStore`` on the driver.

    Every request is an authenticated frame; blocking ``get``/``wait`` wait on the driver and
    end when the run is aborted. Keys are stored under ``prefix``. The caller must keep this
    object alive while c10d uses it: c10d finds the Python methods through the Python object.
    """

    def __init__(self, client: ServiceClient, prefix: str = ""):
        super().__init__()
        self._client = client
        self._prefix = prefix

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def set(self, key, value):
        self._client.ask(dm.StoreSet(key=self._k(key)), _bytes(value))

    def get(self, key):
        return bytes(self._client.ask(dm.StoreGet(key=self._k(key), timeout=self._timeout_s())).blob)

    def add(self, key, amount):
        return self._value(dm.StoreAdd(key=self._k(key), amount=int(amount)))

    def compare_set(self, key, expected, desired):
        expected, desired = _bytes(expected), _bytes(desired)
        return self._client.ask(dm.StoreCas(key=self._k(key), expected_len=len(expected)), expected + desired).blob

    def check(self, keys):
        return self._value(dm.StoreCheck(keys=[self._k(k) for k in keys]))

    def wait(self, keys, timeout=None):
        seconds = timeout.total_seconds() if timeout is not None else self._timeout_s()
        self._client.ask(dm.StoreWait(keys=[self._k(k) for k in keys], timeout=seconds))

    def delete_key(self, key):
        return self._value(dm.StoreDelete(key=self._k(key)))

    def num_keys(self):
        return self._value(dm.StoreNumKeys())

    def _value(self, request):
        return dm.decode(dm.StoreValue, self._client.ask(request).meta).value


def _bytes(value) -> bytes:
    """Store values as bytes; strings as UTF-8, as HashStore takes them."""
    return value.encode() if isinstance(value, str) else bytes(value)
