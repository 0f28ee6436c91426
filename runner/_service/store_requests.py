"""The ranks' rendezvous store (``_common/rendezvous.py``), served over the driver service's STORE_*
frames; a blocked get or wait ends when the run does.

Part of ``DriverService`` (``_service/service.py``), whose ``store`` these handlers serve.
"""

from __future__ import annotations

from ..._common.driver_messages import (
    StoreAdd,
    StoreCas,
    StoreCheck,
    StoreDelete,
    StoreGet,
    StoreSet,
    StoreValue,
    StoreWait,
    encode,
)
from ..._common.protocol import AuthenticatedChannel, Kind
from ..._common.rendezvous import RendezvousStore, StoreClosed, StoreTimeout

STORE_KINDS = (Kind.STORE_SET, Kind.STORE_GET, Kind.STORE_ADD, Kind.STORE_CHECK, Kind.STORE_WAIT,
               Kind.STORE_CAS, Kind.STORE_DELETE, Kind.STORE_NUM_KEYS)


class StoreHandlers:
    """The STORE_* requests. Uses ``DriverService``'s ``store``."""

    def _store_request(self, channel: AuthenticatedChannel, request, blob: bytes, peer: str) -> None:
        """Answer a STORE_* request from ``self.store``: OK, or ABORT if the run ends first."""
        try:
            meta, answer = call_store(self.store, request, blob)
        except StoreClosed:
            return self._abort_reply(channel)
        except StoreTimeout as exc:
            return self._refuse(channel, str(exc))
        channel.send(Kind.OK, meta, answer)


def call_store(store: RendezvousStore, request, blob: bytes) -> tuple[dict, bytes]:
    """Call the store for one STORE_* request (_common/driver_messages.py) and return the OK reply's meta and blob."""
    if isinstance(request, StoreSet):
        store.set(request.key, blob)
        return {}, b""
    if isinstance(request, StoreGet):
        return {}, store.get(request.key, request.timeout)
    if isinstance(request, StoreAdd):
        return encode(StoreValue(store.add(request.key, request.amount))), b""
    if isinstance(request, StoreCheck):
        return encode(StoreValue(store.check(request.keys))), b""
    if isinstance(request, StoreWait):
        store.wait(request.keys, request.timeout)
        return {}, b""
    if isinstance(request, StoreCas):
        n = request.expected_len
        return {}, store.compare_set(request.key, blob[:n], blob[n:])
    if isinstance(request, StoreDelete):
        return encode(StoreValue(store.delete_key(request.key))), b""
    return encode(StoreValue(store.num_keys())), b""  # StoreNumKeys, the last of STORE_KINDS
