"""Binary columns and the ``decode=`` hook, on real Parquet files of encoded images (PNG through PIL where it
installs, else NumPy's .npy bytes, which need nothing)."""

from __future__ import annotations

import io
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkhvd.data import make_batch_reader, make_reader
from sparkhvd.data.torch import make_torch_loader

pytestmark = pytest.mark.unit


def _encode(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, image, allow_pickle=False)
    return buffer.getvalue()


def _decode(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _images(i: int, shape=(4, 5, 3)) -> np.ndarray:
    return np.full(shape, i, dtype=np.uint8)


@pytest.fixture
def images(tmp_path):
    """12 rows over 3 row groups: ``id`` and ``image``, the .npy bytes of a 4x5x3 uint8 image filled with the id."""
    table = pa.table({"id": pa.array(range(12), pa.int64()),
                      "image": pa.array([_encode(_images(i)) for i in range(12)], pa.binary())})
    (tmp_path / "images").mkdir()
    pq.write_table(table, tmp_path / "images" / "part-0.parquet", row_group_size=4)
    return tmp_path / "images"


def test_binary_columns_pass_through_as_bytes(images):
    with make_batch_reader(images, shuffle_row_groups=False) as reader:
        batch = next(reader)
    assert all(isinstance(cell, bytes) for cell in batch.image) and _decode(batch.image[0]).shape == (4, 5, 3)


def test_decode_runs_in_the_prefetch_threads_and_a_batch_is_one_array(images):
    threads = set()

    def decode(data):
        threads.add(threading.current_thread().name)
        return _decode(data)

    with make_batch_reader(images, decode={"image": decode}, batch_size=5, shuffle_row_groups=False) as reader:
        batches = list(reader)
    assert [b.image.shape for b in batches] == [(5, 4, 5, 3), (5, 4, 5, 3), (2, 4, 5, 3)]
    assert all((b.image == b.id[:, None, None, None]).all() for b in batches)
    assert threads and all(name.startswith("sparkhvd-data") for name in threads)
    with make_torch_loader(images, batch_size=6, decode={"image": _decode}) as loader:
        tensors = list(loader)
    assert [tuple(t["image"].shape) for t in tensors] == [(6, 4, 5, 3), (6, 4, 5, 3)]
    with make_reader(images, decode={"image": _decode}, shuffle_row_groups=False) as rows:
        first = next(rows)
    assert first.image.shape == (4, 5, 3) and int(first.image[0, 0, 0]) == first.id == 0


def test_a_pil_decoder_reads_png_bytes(tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    pngs = []
    for i in range(3):
        buffer = io.BytesIO()
        Image.fromarray(_images(i * 40, (6, 7, 3))).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    pq.write_table(pa.table({"png": pa.array(pngs, pa.binary())}), tmp_path / "part-0.parquet")
    decode = {"png": lambda data: np.asarray(Image.open(io.BytesIO(data)))}
    with make_batch_reader(tmp_path, decode=decode, shuffle_row_groups=False) as reader:
        batch = next(reader)
    assert batch.png.shape == (3, 6, 7, 3) and batch.png[:, 0, 0, 0].tolist() == [0, 40, 80]


def test_decode_errors_say_what_to_do(images, tmp_path):
    with pytest.raises(ValueError, match=r"decode names column\(s\) \['picture'\] that the reader does not yield"):
        make_batch_reader(images, decode={"picture": _decode})
    with pytest.raises(TypeError, match=r"decode must map column names to functions, got \['image'\]"):
        make_batch_reader(images, decode=["image"])
    ragged = tmp_path / "ragged"
    ragged.mkdir()
    pq.write_table(pa.table({"image": [_encode(_images(0, (2, 2))), _encode(_images(1, (3, 2)))]}), ragged / "p.parquet")
    with pytest.raises(ValueError, match=r"decode\['image'\] returned arrays of different shapes or dtypes in row group "
                                         r"0 of .*: \(2, 2\) \|u1 and \(3, 2\) \|u1; return one shape"):
        list(make_batch_reader(ragged, decode={"image": _decode}))

    across = tmp_path / "across"
    across.mkdir()  # each row group decodes to one shape, but not the same one: a batch across them cannot be one array
    pq.write_table(pa.table({"image": [_encode(_images(0, (2, 2))), _encode(_images(1, (3, 2)))]}), across / "p.parquet",
                   row_group_size=1)
    with pytest.raises(ValueError, match=r"decode of \['image'\] gave one row group's cells another shape or dtype "
                                         r"than the row group's before, and a batch spans both"):
        list(make_batch_reader(across, decode={"image": _decode}, batch_size=2, shuffle_row_groups=False))

    def broken(data):
        raise KeyError("no codec")

    with pytest.raises(KeyError, match="no codec") as info:
        list(make_batch_reader(images, decode={"image": broken}))
    assert any("raised by decode['image'] on a cell of row group" in note for note in info.value.__notes__)
