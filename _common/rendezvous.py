"""The rendezvous store's server side: the key-value dict the ranks' process groups are built from.

``RendezvousStore`` keeps c10d Store semantics (set, blocking get and wait, add, compare-set,
check, delete, count) over plain Python values; it knows nothing of frames or torch, so the
driver imports it without torch. ``runner/_service/service.py`` serves it over its authenticated frames
(``Kind.STORE_*``), and ``collective/_engine/store.py``'s ``DriverStore`` is the ranks' c10d client.
It shares the service's condition variable and asks ``closed()`` whether the run is over, so
the service's abort and close, which notify that condition, end every blocked get and wait.
"""

from __future__ import annotations

import threading
from typing import Callable


class StoreTimeout(TimeoutError):
    """A blocking ``get`` or ``wait`` ran past its timeout; the message names the key(s)."""


class StoreClosed(RuntimeError):
    """The store closed (its run was aborted or finished) while a ``get`` or ``wait`` was blocked."""


class RendezvousStore:
    """A thread-safe c10d-style key-value store whose blocking calls end when ``closed()``.

    ``cv`` guards the keys; whoever makes ``closed()`` true must notify it. Values are bytes.
    """

    def __init__(self, cv: threading.Condition, closed: Callable[[], bool]):
        self._cv = cv
        self._closed = closed
        self._keys: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._keys[key] = value
            self._cv.notify_all()

    def get(self, key: str, timeout: float | None) -> bytes:
        """The key's value, once it is set; raises StoreTimeout or StoreClosed first."""
        self._wait_for(lambda: key in self._keys, timeout, f"key {key!r}")
        with self._cv:
            return self._keys[key]

    def wait(self, keys: list, timeout: float | None) -> None:
        """Return once every key is set; raises StoreTimeout or StoreClosed first."""
        self._wait_for(lambda: all(k in self._keys for k in keys), timeout, f"keys {keys}")

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the key's integer value (0 when unset) and return the sum."""
        with self._cv:
            value = int(self._keys.get(key, b"0")) + amount
            self._keys[key] = str(value).encode()
            self._cv.notify_all()
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``desired`` if the key holds ``expected`` (or is unset and ``expected`` is empty).

        Returns the value the key holds afterwards, or ``expected`` when the key is unset, as
        c10d's ``compare_set`` does.
        """
        with self._cv:
            current = self._keys.get(key)
            if (current is None and expected == b"") or current == expected:
                self._keys[key] = current = desired
                self._cv.notify_all()
            elif current is None:
                current = expected
        return current

    def check(self, keys: list) -> bool:
        """Whether every key is set, without waiting."""
        with self._cv:
            return all(k in self._keys for k in keys)

    def delete_key(self, key: str) -> bool:
        """Delete the key; whether it was set."""
        with self._cv:
            return self._keys.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cv:
            return len(self._keys)

    def snapshot(self) -> dict[str, bytes]:
        """A copy of every key and value, for tests and diagnostics."""
        with self._cv:
            return dict(self._keys)

    def _wait_for(self, ready: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Return once ``ready()``; raise StoreClosed if the store closes first, else StoreTimeout."""
        with self._cv:
            self._cv.wait_for(lambda: ready() or self._closed(), timeout)
            if ready():
                return
            if self._closed():
                raise StoreClosed("the store closed while waiting for " + what)
        raise StoreTimeout(f"timed out after {timeout} s waiting for {what}")
