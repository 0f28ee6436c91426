"""Petastorm's reader arguments that sparkhvd's own signature lacks: accepted, noted once, or refused in a sentence.

Petastorm code passes them (``reader_pool_type='process'``, ``results_queue_size=``, ``cache_type='null'``); each
one here either means what it says in sparkhvd (``storage_options``, ``filesystem``, ``reader_pool_type='dummy'``),
does not apply and is noted once per process where its value asks for something (``results_queue_size``,
``shard_seed``), or would change which rows are read and is refused (``predicate``, ``transform_spec``). docs/data.md
lists them all, with make_batch_reader's and make_reader's own arguments.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any

#: Petastorm's arguments, by function, with their Petastorm defaults (petastorm/reader.py, 0.12)
COMMON = {"reader_pool_type": "thread", "shuffle_row_drop_partitions": 1, "predicate": None, "rowgroup_selector": None,
          "shard_seed": None, "cache_type": "null", "cache_location": None, "cache_size_limit": None,
          "cache_row_size_estimate": None, "cache_extra_settings": None, "hdfs_driver": "libhdfs3",
          "transform_spec": None, "storage_options": None, "zmq_copy_buffers": True, "filesystem": None}
ROW_ONLY = {"results_queue_size": 50, "pyarrow_serialize": False}

_noted: set[str] = set()
_noted_lock = threading.Lock()


class PetastormArgumentWarning(UserWarning):
    """A Petastorm argument that does not apply to sparkhvd's reader, noted once per process."""


@dataclass(frozen=True)
class Options:
    """What the accepted Petastorm arguments mean here."""

    storage_options: dict | None = None
    filesystem: Any = None
    single_thread: bool = False  # reader_pool_type='dummy': read in one thread


def take(function: str, given: dict) -> Options:
    """Check ``given`` (the keywords a make_*_reader call had beyond its own), note or refuse as the module says."""
    known = {**COMMON, **(ROW_ONLY if function == "make_reader" else {})}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}; its arguments are its own "
                        f"(see help({function})) and Petastorm's {sorted(known)}.")
    args = {**known, **given}
    pool = args["reader_pool_type"]
    if pool not in ("thread", "process", "dummy"):
        raise ValueError(f"reader_pool_type={pool!r} is not one of Petastorm's 'thread', 'process' and 'dummy'; "
                         "pass 'thread' (sparkhvd reads in threads) or leave it out.")
    if pool == "process":
        _note("reader_pool_type", "reader_pool_type='process': sparkhvd reads row groups in workers_count threads "
              "(pyarrow decodes Parquet without holding the GIL), so no process pool is started.")
    _refuse_unless(args["shuffle_row_drop_partitions"] == 1, "shuffle_row_drop_partitions",
                   args["shuffle_row_drop_partitions"], "pass shuffle_rows=True, which permutes every row-group slice "
                   "a shard reads, without Petastorm's extra reads")
    _refuse_unless(args["predicate"] is None, "predicate", args["predicate"],
                   "pass filters=, a pyarrow expression or DNF list such as [('label', '=', 3)], which the plan "
                   "balances across shards")
    _refuse_unless(args["rowgroup_selector"] is None, "rowgroup_selector", args["rowgroup_selector"],
                   "pass filters= on the columns the selector's index was built from")
    _refuse_unless(args["transform_spec"] is None, "transform_spec", args["transform_spec"],
                   "transform the batches in the training loop (or a DataLoader's collate_fn)")
    cache = args["cache_type"]
    if cache not in (None, "null", "local-disk"):
        raise ValueError(f"cache_type={cache!r} is not one of Petastorm's None, 'null' and 'local-disk'; leave it "
                         "out.")
    _refuse_unless(cache != "local-disk", "cache_type", cache,
                   "leave it out, and copy the dataset to a local disk first where reading it each epoch is slow",
                   why="it keeps no cache of its own: every epoch reads the dataset")
    if args["shard_seed"] is not None:
        _note("shard_seed", f"shard_seed={args['shard_seed']!r}: shards are cut by rows from the order seed= gives "
              "each epoch, so shard_seed has no effect; pass seed= for another order.")
    if function == "make_reader" and args["results_queue_size"] != ROW_ONLY["results_queue_size"]:
        _note("results_queue_size", f"results_queue_size={args['results_queue_size']!r}: the reader holds "
              "workers_count + 2 row groups read ahead, so results_queue_size has no effect.")
    if args["hdfs_driver"] != COMMON["hdfs_driver"]:
        _note("hdfs_driver", f"hdfs_driver={args['hdfs_driver']!r}: hdfs:// URLs go through pyarrow's "
              "HadoopFileSystem (libhdfs), so hdfs_driver has no effect.")
    options = args["storage_options"]
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"storage_options must be a dict of fsspec options, got {type(options).__name__} "
                        f"{options!r}; e.g. storage_options={{'anon': True}}.")
    return Options(storage_options=options, filesystem=args["filesystem"], single_thread=pool == "dummy")


def _refuse_unless(ok: bool, name: str, value, fix: str, why: str = "it changes which rows are read, and the plan "
                   "must know them to balance the shards") -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not supported by sparkhvd's reader ({why}); {fix}.")


def _note(key: str, message: str) -> None:
    with _noted_lock:
        if key in _noted:
            return
        _noted.add(key)
    warnings.warn(message, PetastormArgumentWarning, stacklevel=4)
