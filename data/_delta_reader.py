"""make_delta_reader: the batch reader over a Delta table's version (the log's files: data/_delta.py)."""

from __future__ import annotations

import os
from typing import Sequence

from ._delta import table_listing
from ._petastorm_args import Options
from ._reader import DEFAULT_WORKERS, Reader, _build


def make_delta_reader(
    table_uri: str | os.PathLike,
    *,
    version: int | None = None,
    timestamp=None,
    storage_options: dict | None = None,
    cur_shard: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = 1,
    shuffle_row_groups: bool = True,
    shuffle_rows: bool = False,
    seed: int | None = None,
    schema_fields: Sequence[str] | None = None,
    filters=None,
    batch_size: int | None = None,
    equal_steps: bool = True,
    workers_count: int = DEFAULT_WORKERS,
    resume_from: tuple[int, int] | None = None,
    decode: dict | None = None,
    global_order: bool = False,
) -> Reader:
    """A reader of one shard of a Delta table, as make_batch_reader reads a Parquet dataset.

    ``table_uri``: the table's directory or URL, as ``deltalake.DeltaTable`` takes it (the
    ``delta`` extra: ``pip install 'sparkhvd[delta]'``). ``version`` (an int) or ``timestamp`` (a
    datetime or ISO 8601 string) reads that version (time travel); neither, the newest.
    ``storage_options``: delta-rs's options for a remote table (``AWS_ENDPOINT_URL``,
    ``AWS_REGION``, ...). An S3 table's files (``s3://``, ``s3a://``) are read through pyarrow's
    S3 filesystem with the endpoint (its scheme, or ``http`` where ``AWS_ALLOW_HTTP`` is true),
    region, credentials and ``AWS_VIRTUAL_HOSTED_STYLE_REQUEST`` of those options; what they do
    not say comes from the environment (AWS_* variables, ~/.aws), as delta-rs takes it. Another
    remote table's files are read through pyarrow's filesystem for their URLs, configured by the
    environment only. The reader reads the files the table's log lists for
    the version, never files the log has removed; partition columns come from the log, typed by
    the table's schema, and the columns in the schema's order unless ``schema_fields`` says
    otherwise. Tables with deletion vectors or column mapping are refused with ValueError
    (sparkhvd does not apply them yet). Every other argument is make_batch_reader's, with its
    meaning: shards are balanced by rows, ``filters`` may name partition columns, and
    ``resume_from`` resumes mid-epoch (with the same ``version``), ``decode`` decodes binary
    cells in the prefetch threads, ``global_order`` reads in one order at any ``shard_count``.
    """
    files, partitions, columns, filesystem = table_listing(table_uri, version=version, timestamp=timestamp,
                                                           storage_options=storage_options)
    if not files:
        raise ValueError(f"The Delta table {os.fspath(table_uri)!r} has no data files in the version read; write "
                         "rows to it first, or pass a version that has them.")
    return _build(
        files, cur_shard=cur_shard, shard_count=shard_count, num_epochs=num_epochs,
        shuffle_row_groups=shuffle_row_groups, shuffle_rows=shuffle_rows, seed=seed,
        schema_fields=list(columns) if schema_fields is None else schema_fields, filters=filters,
        batch_size=batch_size, equal_steps=equal_steps, workers_count=workers_count, resume_from=resume_from,
        petastorm=Options(filesystem=filesystem), partitions=partitions,
        described_as=f"the Delta table {os.fspath(table_uri)!r}",
        fill_missing=True,  # files written before a column was added (schema evolution) read it as null
        decode=decode, global_order=global_order,
    )
