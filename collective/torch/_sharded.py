"""Sharded commits: a ``TorchState`` whose model is sharded (FSDP2's ``fully_shard``) commits each rank's shard.

Gathering a sharded model to rank 0 for every commit is slow, and for a model larger than one host's memory,
impossible. So where a module's parameters are DTensors, the state keeps it (and the optimizer that steps it)
through ``torch.distributed.checkpoint.state_dict``: ``save()`` copies this rank's shard in its memory, as
Horovod's commit copies the whole state, and ``sync()`` leaves it alone (each rank's shard is its own).

Inside a HorovodRunner run with a folder for commits (``commit_dir=``, or ``run_id=`` with ``storage=``), every
rank's ``commit()`` then hands its copy to a thread (``ShardWriter``) that writes it there with
``torch.distributed.checkpoint.save``, into ``<folder>/<state>-<seq>-<token>.dcp/``, over a gloo group of its
own; the loop goes on meanwhile. The ranks hash the files they wrote between them, and rank 0 sends the driver
only the folder's name and the digests, with the state's plain values. A restarted run (or a new driver's) loads
every rank's part with ``torch.distributed.checkpoint.load``, which reshards where the number of ranks changed,
after the ranks have checked every file's digest between them: the driver never carries a shard, and no rank
loads DCP's pickled ``.metadata`` before it matches the digest the driver recorded.

Without such a folder the sharded part cannot leave the ranks: it is kept in memory only (``restore()`` works),
nothing of the state is sent to the driver, and a restart starts the state over; a rank says so once.
"""

from __future__ import annotations

import copy
import os
import secrets
import threading

import torch

from ..._common import commits as _commits
from ..._common.commits import _safe
from .._core import allgather_object, broadcast_object, rank, size

METADATA = ".metadata"  # DCP's file of what is where, written by its coordinator (rank 0)
_warned: set = set()


def is_sharded_module(value) -> bool:
    """Whether ``value`` is a module with a DTensor parameter (FSDP2's ``fully_shard``, a tensor-parallel plan)."""
    if not isinstance(value, torch.nn.Module):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in value.parameters())


def is_sharded_optimizer(value) -> bool:
    if not isinstance(value, torch.optim.Optimizer):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in value.param_groups for p in group["params"])


class ShardedModelHandler:
    """A sharded module's part of a TorchState: this rank's shard, by parameter name (DCP's model state dict)."""

    def __init__(self, value):
        self.value = value
        self.save()

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.value)

    def save(self) -> None:
        self._saved = copy.deepcopy(self.state_dict())  # a copy: the shard's tensors change with the next step

    def restore(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.value, copy.deepcopy(self._saved))

    def sync(self) -> None:
        """Nothing: each rank's shard is its own, and rank 0's would not fit the others' places."""

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class ShardedOptimizerHandler(ShardedModelHandler):
    """The optimizer of a sharded module: its state by parameter name (DCP's optimizer state dict)."""

    def __init__(self, value, model):
        self.model = model
        super().__init__(value)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.value)

    def restore(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.value, copy.deepcopy(self._saved))


def is_deepspeed_engine(value) -> bool:
    """Whether ``value`` is a DeepSpeed engine (``deepspeed.initialize``'s first value), without importing DeepSpeed."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed.")
               for c in type(value).__mro__)


class DeepSpeedHandler:
    """A DeepSpeed engine's part of a TorchState. Its model and its ZeRO optimizer's partitions are written at each
    commit by the engine's own ``save_checkpoint`` (every rank its partition), and ``restore()`` loads the newest
    one written with ``load_checkpoint``: ``save()`` alone keeps nothing, as a copy of a ZeRO state in memory has
    no loader of DeepSpeed's."""

    def __init__(self, value):
        self.value = value
        self._saved = None  # (folder, tag) of the newest commit written

    def save(self) -> None:
        """Nothing: the commit writes the engine's checkpoint (``write_deepspeed``)."""

    def restore(self) -> None:
        if self._saved is None:
            raise RuntimeError("hvd.elastic.TorchState: a DeepSpeed engine is restored from its newest commit, and "
                               "none was written: its state is written by commit() inside a HorovodRunner run with a "
                               "folder for commits (commit_dir=, or run_id= with storage=).")
        folder, tag = self._saved
        self.value.load_checkpoint(folder, tag=tag)

    def sync(self) -> None:
        """Nothing: each rank holds its own partition of the optimizer."""

    def set_value(self, value) -> None:
        self.value = value


def sharded_handlers(values: dict) -> dict:
    """The TorchState keywords whose values are sharded, each with its handler; TypeError for an optimizer of
    sharded parameters whose module is not in the state, and for a DeepSpeed engine's optimizer or a DeepSpeed
    engine beside a DTensor model."""
    engines = {name: DeepSpeedHandler(v) for name, v in values.items() if is_deepspeed_engine(v)}
    parts = [p for h in engines.values() for p in (getattr(h.value, "optimizer", None),
                                                     getattr(h.value, "lr_scheduler", None)) if p is not None]
    for name, value in values.items():
        if any(value is part for part in parts):
            raise TypeError(f"hvd.elastic.TorchState: {name}= is DeepSpeed's {type(value).__name__}, which its engine's "
                            f"checkpoint holds; pass the engine alone, as TorchState(model=engine), and leave {name}= "
                            "out.")
    if engines:
        if any(is_sharded_module(v) for v in values.values()):
            raise TypeError("hvd.elastic.TorchState: a DeepSpeed engine and a DTensor (FSDP2) model in one state are "
                            "committed two ways at once; give each its own TorchState.")
        return engines
    handlers = {name: ShardedModelHandler(v) for name, v in values.items() if is_sharded_module(v)}
    for name, value in values.items():
        if not is_sharded_optimizer(value):
            continue
        params = {id(p) for group in value.param_groups for p in group["params"]}
        model = next((h.value for h in handlers.values()
                      if isinstance(h, ShardedModelHandler) and params & {id(p) for p in h.value.parameters()}), None)
        if model is None:
            raise TypeError(f"hvd.elastic.TorchState: the optimizer {name}= steps sharded (DTensor) parameters, but "
                            "no module of the state holds them, and its state is kept by parameter name; pass the "
                            f"sharded model too, as TorchState(model=model, {name}=optimizer).")
        handlers[name] = ShardedOptimizerHandler(value, model)
    return handlers


# ---- writing and reading a commit's shards ---------------------------------------------------------------------

class ShardWriter:
    """One state's sharded commits, each written by every rank on a thread of its own, so ``commit()`` blocks the
    loop only for the copy of this rank's shard (as ``torch.distributed.checkpoint.async_save``).

    DCP's collectives and the digests' go over a gloo group of their own, made at the first commit, so they never
    cross the training's on the default group. A commit waits for the one before it; rank 0 publishes each once
    every rank's files are written and hashed (``_common/commits.py``), and ``commits.flush()`` waits for it.
    """

    def __init__(self):
        self._group = None
        self._world = None  # the default group the writer's group was made from
        self._token = None
        self._thread: threading.Thread | None = None

    def start(self, key: str, seq: int, saved: dict, publish) -> None:
        """Every rank: write ``saved`` (name -> this rank's saved state dict) as commit ``seq`` of state ``key``,
        then ``publish(shards)`` on rank 0, ``shards`` being the commit's meta (its folder, each file's SHA-256
        and size, their total). Where the run has no folder for commits, nothing is written (said once)."""
        import torch.distributed as dist

        where = _commits.run_folder()
        if where is None:
            _say_not_resumable(key)
            return
        self.wait()
        if self._group is None or self._world is not dist.group.WORLD:  # first commit, or a new default group
            self._world, self._group = dist.group.WORLD, dist.new_group(backend="gloo")
            self._token = new_token()
        url = _commits.join_url(where, f"{_safe(key)}-{seq}-{self._token}.dcp")
        target = _target(url, write=True)  # here, so that a missing fsspec raises on every rank, not in one thread
        thread = threading.Thread(target=self._write, args=(url, target, seq, key, saved, publish, rank(), size()),
                                  name=f"sparkhvd-shards-{key}", daemon=True)
        _commits.writing(thread)
        self._thread = thread
        thread.start()

    def wait(self) -> None:
        """Until the commit being written (if any) is written and published."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, url: str, target: dict, seq: int, key: str, saved: dict, publish, me: int, ranks: int) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        try:
            try:
                metadata = dcp.save(saved, process_group=self._group, **target)
            except Exception as exc:  # noqa: BLE001 - DCP raises on every rank together; the run goes on
                mine = f"{type(exc).__name__}: {exc}"
            else:
                files = sorted({info.relative_path for info in metadata.storage_data.values()})
                try:
                    mine = {name: _commits.file_digest(url, name)
                            for name in files[me::ranks] + ([METADATA] if me == 0 else [])}
                except Exception as exc:  # noqa: BLE001 - said below, by rank 0, for every rank
                    mine = f"{type(exc).__name__}: {exc}"
                parts = [None] * ranks
                try:
                    dist.all_gather_object(parts, mine, group=self._group)
                except Exception as exc:  # noqa: BLE001 - a peer lost: the driver restarts the run
                    parts = [f"{type(exc).__name__}: {exc}"]
                mine = next((p for p in parts if isinstance(p, str)), mine)
            if isinstance(mine, str):
                if me == 0:
                    _commits.remove_shards({"path": url})
                    print(f"sparkhvd: could not write commit {seq} of {key} to {url}: {mine}; the previous commit "
                          "stays the one a restart resumes from. Check that every rank can write to the run's "
                          "folder (free space, permissions).", flush=True)
                return
            if me == 0:
                digests = {name: d for part in parts for name, d in part.items()}
                publish(_commits.folder_meta(url, digests))
        finally:
            _commits.written(threading.current_thread())


def read(shards: dict, handlers: dict) -> None:
    """Every rank: check the commit's files (each by one rank), then load this rank's part into ``handlers`` (name ->
    sharded handler) and restore them; DCP reshards where the commit was made with another number of ranks."""
    import torch.distributed.checkpoint as dcp

    url = shards["path"]
    _check(url, shards["sha256"])
    template = {name: handler.state_dict() for name, handler in handlers.items()}
    dcp.load(template, **_target(url, write=False))
    for name, handler in handlers.items():
        handler._saved = copy.deepcopy(template[name])
        handler.restore()


def write_deepspeed(key: str, seq: int, token: str, handlers: dict) -> dict | None:
    """Every rank, on the training's thread (DeepSpeed's collectives are the training's): each engine of
    ``handlers`` (name -> DeepSpeedHandler) writes its checkpoint with ``save_checkpoint``, tag ``name``, into
    ``<folder>/<key>-<seq>-<token>.ds``; the commit's ``shards`` meta, or None where the run has no folder."""
    where = _commits.run_folder()
    if where is None:
        _say_not_resumable(key)
        return None
    if "://" in where and not where.startswith("file://"):
        raise RuntimeError(f"hvd.elastic.TorchState: DeepSpeed writes its checkpoint to a local folder, and this run's "
                           f"commits go to {where}; give HorovodRunner a storage path every host mounts (/dbfs/..., "
                           "an NFS mount) for a DeepSpeed engine's commits.")
    url = f"{where.removeprefix('file://')}/{_safe(key)}-{seq}-{token}.ds"
    for name, handler in handlers.items():
        handler.value.save_checkpoint(url, tag=name, save_latest=False)
        handler._saved = (url, name)
    # every rank's files are written before rank 0 lists them; each rank then hashes its share of rank 0's list
    files = broadcast_object(_commits.files_under(url) if rank() == 0 else None)
    try:
        mine = {name: _commits.file_digest(url, name) for name in files[rank()::size()]}
    except Exception as exc:  # noqa: BLE001 - gathered: every rank raises it together
        mine = f"{type(exc).__name__}: {exc}"
    parts = allgather_object(mine)
    failed = next((p for p in parts if isinstance(p, str)), None)
    if failed is not None:
        raise RuntimeError(f"hvd.elastic.TorchState: commit {seq} of {key} was written to {url}, but a rank could not "
                           f"read it back: {failed}. Give HorovodRunner a folder every rank reaches (one shared "
                           "mount, not a local path on each host).")
    digests: dict = {}
    for part in parts:
        digests.update(part)
    return dict(_commits.folder_meta(url, digests), deepspeed=sorted(handlers))


def read_deepspeed(shards: dict, handlers: dict, made_with: int) -> None:
    """Every rank: check the commit's files, then load each engine's checkpoint (the number of ranks that wrote it
    only: DeepSpeed's ZeRO partitions do not reshard without its universal-checkpoint conversion)."""
    url = shards["path"]
    if made_with != size():
        raise ValueError(f"the DeepSpeed commit {url} was written by {made_with} ranks and this run has {size()}: "
                         "DeepSpeed loads its ZeRO partitions at the number of ranks that wrote them; run with "
                         f"np={made_with}, or convert the checkpoint with DeepSpeed's ds_to_universal and load it "
                         "yourself.")
    _check(url, shards["sha256"])
    for name, handler in handlers.items():
        loaded, _ = handler.value.load_checkpoint(url, tag=name)
        if loaded is None:  # DeepSpeed returns (None, None) where it found nothing to load
            raise ValueError(f"DeepSpeed found no checkpoint {name!r} in the commit {url}, whose files matched their "
                             "digests; the engine in this state is not the one that wrote it. Give the state the same "
                             "keyword for the engine as the run that wrote it, or a new run_id.")
        handler._saved = (url, name)


def _check(url: str, digests: dict) -> None:
    """Every rank: each file of the commit checked by one rank; ValueError on every rank where one is not the same."""
    wrong = _commits.changed_files(url, digests, sorted(digests)[rank()::size()])
    wrong = [w for part in allgather_object(wrong) for w in part]
    if wrong:
        raise ValueError(f"the sharded commit {url} is not the one its ranks wrote: {', '.join(wrong)} do not match "
                         "the SHA-256 the driver recorded; something else wrote to the run's folder. Give each run a "
                         "folder only it writes to (or a new run_id). Nothing was loaded from it.")


def _say_not_resumable(key: str) -> None:
    if key not in _warned and rank() == 0:
        _warned.add(key)
        print(f"sparkhvd: {key} holds a sharded model, whose shards cannot go to the driver; its commits stay in the "
              "ranks' memory only, so a restart starts it over. Give HorovodRunner a folder every rank reaches "
              "(commit_dir=, or run_id= with storage=) to resume it.", flush=True)


def new_token() -> str:
    """A name part every rank agrees on (rank 0's): this attempt's commit folders are never another's."""
    return broadcast_object(secrets.token_hex(4) if rank() == 0 else None)


def _target(url: str, *, write: bool) -> dict:
    """DCP's checkpoint arguments for ``url``: a local folder, or an fsspec URL."""
    if "://" not in url or url.startswith("file://"):
        path = url[len("file://"):] if url.startswith("file://") else url
        return {"checkpoint_id": os.path.abspath(path)}
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    except ImportError as exc:  # fsspec is not installed
        raise RuntimeError(f"sharded commits to {url} need fsspec (and its package for that scheme, such as s3fs): "
                           "pip install fsspec s3fs, or give a local folder every rank reaches.") from exc
    return {"storage_writer": FsspecWriter(url)} if write else {"storage_reader": FsspecReader(url)}

