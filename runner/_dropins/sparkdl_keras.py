"""Databricks' ``sparkdl.horovod.tensorflow.keras.LogCallback``, run by sparkhvd (runner/_rank/aliases.py)."""

from __future__ import annotations

import numbers
import time

import keras

from .._rank.log import log_to_driver

__all__ = ["LogCallback"]


class LogCallback(keras.callbacks.Callback):
    """Sends each epoch's start and end, with its metrics (and each batch's, with ``per_batch_log``), to the
    driver with ``log_to_driver``: shown in the notebook even with ``driver_log_verbosity="log_callback_only"``.

    As on Databricks, add it on the rank whose progress you want to see (``if hvd.rank() == 0``).
    """

    def __init__(self, per_batch_log: bool = False):
        super().__init__()
        self.per_batch_log = per_batch_log
        self._started = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._started = time.monotonic()
        epochs = (self.params or {}).get("epochs")
        log_to_driver(f"Epoch {epoch + 1}/{epochs}" if epochs else f"Epoch {epoch + 1}")

    def on_batch_end(self, batch, logs=None):
        if self.per_batch_log:
            log_to_driver(f"batch {batch + 1}: {_metrics(logs)}")

    def on_epoch_end(self, epoch, logs=None):
        log_to_driver(f"Epoch {epoch + 1} done in {time.monotonic() - self._started:.1f} s: {_metrics(logs)}")


def _metrics(logs) -> str:
    return " - ".join(f"{k}: {float(v):.4f}" if isinstance(v, numbers.Real) else f"{k}: {v}"
                      for k, v in (logs or {}).items())
