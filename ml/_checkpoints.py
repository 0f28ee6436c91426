"""A run's directory in the Store: which model it trains, and a checkpoint per finished epoch.

A checkpoint is a directory ``checkpoints/epoch-<N>/`` (N epochs done) whose files are written
first and whose marker ``_COMPLETE.json`` (each file and its size) is written last; only a
directory whose marker exists and whose files all have the listed sizes is ever read. So a fit
killed while writing one leaves an incomplete directory that the next fit ignores and rewrites,
on every filesystem (object stores have no atomic rename). ``run.json`` records the model's
fingerprint, so a ``run_id`` is never resumed with another model.

Each fit's model (what the executors load to transform) is a file of its own, named by its
content (``model-<digest>.pt``): a later fit of the run (a resume) writes its own beside it, so
a fitted Model's file never changes, and none is deleted while a Model may still read it.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Callable

import pyarrow.fs as pafs

from ._store import Store

MARKER = "_COMPLETE.json"
RUN_FILE = "run.json"
DIGEST_CHARS = 16  # of the sha256 in a model file's name: 64 bits, no collision among a run's fits


def content_name(name: str, data: bytes) -> str:
    """``name`` with the digest of ``data`` before its extension: ``model.pt`` becomes ``model-<digest>.pt``."""
    stem, dot, extension = name.partition(".")
    return f"{stem}-{hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]}{dot}{extension}"


class RunDir:
    """``runs/<run_id>/`` in ``store``."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id = store, run_id
        self.url = store.get_run_path(run_id)
        self.checkpoints_url = store.get_checkpoint_path(run_id)

    def file_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def write_model(self, name: str, data: bytes) -> str:
        """Write a fitted model's bytes as the file of their own, ``content_name(name, data)``; its URL.

        A file there already holds these bytes (the same model fitted twice) and is kept as it is, unless a fit
        killed while writing it left it cut short. No other model file of the run is touched: each is the file of a
        Model that may still transform.
        """
        url = self.file_url(content_name(name, data))
        info = self.store.filesystem.get_file_info(self.store.path_of(url))
        if info.type != pafs.FileType.File or info.size != len(data):
            self.store.write(url, data)
        return url

    def checkpoint_url(self, epoch: int) -> str:
        return f"{self.checkpoints_url}/epoch-{epoch:05d}"

    def claim(self, fingerprint: dict) -> None:
        """Record ``fingerprint`` as this run's model, or check it against the one recorded by an earlier fit.

        Raises ValueError where the run holds checkpoints of another model: resuming them would load
        weights of the wrong shapes, or silently train something else.
        """
        url = self.file_url(RUN_FILE)
        if self.store.exists(url):
            recorded = json.loads(self.store.read(url))
            if recorded.get("fingerprint") != fingerprint:
                raise ValueError(
                    f"run_id={self.run_id!r} in the store {self.store.prefix_path!r} holds checkpoints of another model "
                    f"({_describe(recorded.get('fingerprint'))}), not of this one ({_describe(fingerprint)}); pass a new "
                    "run_id to train this model from the start, or the model that run trained to resume it."
                )
            return
        self.store.write_text(url, json.dumps({"run_id": self.run_id, "fingerprint": fingerprint}, sort_keys=True))

    def newest(self) -> tuple[int, str] | None:
        """``(epochs done, URL)`` of the newest complete checkpoint; None where there is none."""
        names = [name for name in self.store.list_dir(self.checkpoints_url) if name.startswith("epoch-")]
        for name in sorted(names, reverse=True):
            url = f"{self.checkpoints_url}/{name}"
            if self.complete(url):
                return int(name[len("epoch-"):]), url
        return None

    def complete(self, url: str) -> bool:
        """Whether the checkpoint directory ``url`` has its marker and every file the marker lists, whole."""
        fs = self.store.filesystem
        path = self.store.path_of(url)
        try:
            with fs.open_input_stream(posixpath.join(path, MARKER)) as f:
                sizes = json.loads(f.read())["files"]
            infos = fs.get_file_info([posixpath.join(path, name) for name in sizes])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all(info.type == pafs.FileType.File and info.size == sizes[posixpath.basename(info.path)]
                   for info in infos)

    def write_checkpoint(self, epoch: int, files: dict[str, Callable]) -> str:
        """Write checkpoint ``epoch``: each ``files[name](stream)`` writes one file; the marker goes last. Its URL."""
        url = self.checkpoint_url(epoch)
        self.store.delete(url)  # an incomplete one from a killed fit
        fs, path = self.store.filesystem, self.store.path_of(url)
        fs.create_dir(path, recursive=True)
        for name, write in files.items():
            with fs.open_output_stream(posixpath.join(path, name)) as out:
                write(out)
        sizes = {info.path.rsplit("/", 1)[-1]: info.size
                 for info in fs.get_file_info([posixpath.join(path, name) for name in files])}
        with fs.open_output_stream(posixpath.join(path, MARKER)) as out:
            out.write(json.dumps({"epoch": epoch, "files": sizes}, sort_keys=True).encode())
        return url


def _describe(fingerprint) -> str:
    if not isinstance(fingerprint, dict):
        return "an unknown model"
    return (f"a {fingerprint.get('framework')} {fingerprint.get('model')} with {fingerprint.get('tensors')} weight "
            f"tensors, {fingerprint.get('parameters')} parameters")
