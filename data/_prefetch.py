"""An ordered, bounded prefetcher: a thread pool runs ``fn`` ahead over tasks, results come back in task order.

At most ``depth`` tasks are running or finished-but-unconsumed at any time, so memory stays
bounded by ``depth`` results. An exception raised by ``fn`` in a worker thread is re-raised in
the consuming thread when its result is due (never swallowed). ``close()`` cancels what has
not started, waits for what has, and leaves no thread running.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

THREAD_NAME_PREFIX = "sparkhvd-data-reader"


class Prefetcher(Generic[T, R]):
    """Iterator over ``fn(task)`` for ``task in tasks``, computed ahead by ``workers`` threads."""

    def __init__(self, fn: Callable[[T], R], tasks: Iterator[T], *, workers: int, depth: int):
        self._fn = fn
        self._tasks = tasks
        self._depth = max(depth, workers)
        self._pending: deque[Future] = deque()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(workers, thread_name_prefix=THREAD_NAME_PREFIX)
        self._exhausted = False
        self._lock = threading.Lock()  # close() may come from another thread

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self._depth:
            task = next(self._tasks, None)
            if task is None:
                self._exhausted = True
                return
            self._pending.append(self._pool.submit(self._fn, task))

    def __iter__(self) -> Prefetcher[T, R]:
        return self

    def __next__(self) -> R:
        """The next result in task order. Raises CancelledError once closed, so a stop is never mistaken for the end."""
        with self._lock:
            if self._pool is None:
                raise CancelledError("The prefetcher was closed.")
            self._fill()
            if not self._pending:
                raise StopIteration
            future = self._pending.popleft()
        try:
            result = future.result()  # outside the lock: close() may cancel it meanwhile
        except BaseException:
            self.close()
            raise
        with self._lock:
            if self._pool is not None:
                self._fill()
        return result

    def close(self, wait: bool = True) -> None:
        """Cancel tasks not started, wait for running ones (unless ``wait=False``), and stop every thread. Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
            pending = list(self._pending)
            self._pending.clear()
        if pool is None:
            return
        for future in pending:
            future.cancel()
        pool.shutdown(wait=wait, cancel_futures=True)
