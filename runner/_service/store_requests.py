"""The ranks' rendezvous store (``_common/rendezvous.py``), served over the driver service's STORE_*
frames; a blocked get or wait ends when the run does.

Part of ``DriverService`` (``_service/service.py``), whose ``store`` these handlers serve.
"""

from __future__ import annotations

from ..._common.protocol import AuthenticatedChannel, Kind, Message
from ..._common.rendezvous import RendezvousStore, StoreClosed, StoreTimeout

STORE_KINDS = (Kind.STORE_SET, Kind.STORE_GET, Kind.STORE_ADD, Kind.STORE_CHECK, Kind.STORE_WAIT,
               Kind.STORE_CAS, Kind.STORE_DELETE, Kind.STORE_NUM_KEYS)


class StoreHandlers:
    """The STORE_* requests. Uses ``DriverService``'s ``store``."""

    def _store_request(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        """Answer a STORE_* request from ``self.store``: OK, or ABORT if the run ends first."""
        try:
            meta, blob = call_store(self.store, msg)
        except StoreClosed:
            return self._abort_reply(channel)
        except StoreTimeout as exc:
            return self._refuse(channel, str(exc))
        channel.send(Kind.OK, meta, blob)


def call_store(store: RendezvousStore, msg: Message) -> tuple[dict, bytes]:
    """Decode a STORE_* request, call the store, and return the OK reply's meta and blob."""
    meta = msg.meta
    if msg.kind == Kind.STORE_SET:
        store.set(meta["key"], msg.blob)
        return {}, b""
    if msg.kind == Kind.STORE_GET:
        return {}, store.get(meta["key"], meta.get("timeout"))
    if msg.kind == Kind.STORE_ADD:
        return {"value": store.add(meta["key"], int(meta["amount"]))}, b""
    if msg.kind == Kind.STORE_CHECK:
        return {"value": store.check(meta["keys"])}, b""
    if msg.kind == Kind.STORE_WAIT:
        store.wait(meta["keys"], meta.get("timeout"))
        return {}, b""
    if msg.kind == Kind.STORE_CAS:
        n = int(meta["expected_len"])
        return {}, store.compare_set(meta["key"], msg.blob[:n], msg.blob[n:])
    if msg.kind == Kind.STORE_DELETE:
        return {"value": store.delete_key(meta["key"])}, b""
    return {"value": store.num_keys()}, b""  # STORE_NUM_KEYS, the last of STORE_KINDS
