"""An image column through ``decode=``: PNG bytes in a DataFrame, decoded in the ranks' reader threads and in
``transform``, on a real local[2] Spark session, real ranks (np=2) and real Parquet:

- TorchEstimator(decode={"image": fn}) ends with the weights and history (training and validation) of the same fit on
  the same pixels given as an array column, bit for bit: a decode skipped (bytes are no numbers) or run twice (fn
  gets an array) could not; the Parquet the fit wrote keeps the column binary;
- the fitted model's transform decodes with the same fn and predicts every row as the array model does, and so does
  the model saved and loaded (decode kept in it);
- a LightningEstimator fit with decode trains on the decoded images and transforms;
- every mistake with decode fails before anything launches, with one sentence.
"""

from __future__ import annotations

import io
import sys

import cloudpickle
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from sparkhvd.ml import Store, TorchEstimator, TorchModel

Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed (the test extra)")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks and executors cannot import this file

ROWS = 48
SHAPE = (8, 8, 3)


def png(data: bytes) -> np.ndarray:
    """The decoder: a PNG's bytes as its (8, 8, 3) uint8 pixels."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


class Net(torch.nn.Module):
    """Mean brightness from (rows, 8, 8, 3) pixels: a linear layer on the scaled pixels."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(int(np.prod(SHAPE)), 1)

    def forward(self, x):
        return self.linear(x.reshape(len(x), -1) / 255.0)


@pytest.fixture(scope="module")
def df(spark):
    """``image`` (PNG bytes of random 8x8 RGB images, each brighter or darker by its row), the same ``pixels`` as an
    array column, ``y`` (the mean brightness in [0, 1]) and ``held_out`` (every fourth row)."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(ROWS):
        pixels = np.clip(rng.integers(0, 160, SHAPE) + (i % 6) * 19, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        rows.append((bytearray(buffer.getvalue()), pixels.tolist(), float(pixels.mean() / 255), i % 4 == 0))
    return spark.createDataFrame(rows, ["image", "pixels", "y", "held_out"]).cache()


def _estimator(root, feature="image", **kw):
    net = Net()
    args = dict(num_proc=2, store=Store.create(str(root / "store")), model=net,
                optimizer=torch.optim.SGD(net.parameters(), lr=0.005), loss=torch.nn.functional.mse_loss,
                feature_cols=[feature], label_cols=["y"], validation="held_out", batch_size=8, epochs=2,
                random_seed=1, verbose=0)
    if feature == "image":
        args["decode"] = {"image": png}
    args.update(kw)
    return TorchEstimator(**args)


def _weights(model) -> list:
    return [t.detach().clone() for t in model.getModel().state_dict().values()]


def test_a_fit_on_decoded_images_is_the_fit_on_their_pixels_and_transform_decodes_them(df, tmp_path):
    images = df.select("image", "y", "held_out")
    decoded = _estimator(tmp_path).fit(images)
    arrays = _estimator(tmp_path, feature="pixels").fit(df.select("pixels", "y", "held_out"))
    assert all(torch.equal(a, b) for a, b in zip(_weights(decoded), _weights(arrays), strict=True))
    assert decoded.getHistory() == arrays.getHistory()
    assert [set(e) for e in decoded.getHistory()] == [{"epoch", "train", "validation"}] * 2
    assert decoded.getHistory()[1]["train"]["loss"] < decoded.getHistory()[0]["train"]["loss"]
    written = [pq.read_schema(path) for path in (tmp_path / "store").rglob("*.parquet")]
    assert {str(s.field("image").type) for s in written if "image" in s.names} == {"binary"}  # as the DataFrame has it

    out = [r.y__output for r in decoded.transform(images).select("y__output").collect()]
    assert len(out) == ROWS and all(isinstance(v, float) for v in out)
    assert out == [r.y__output for r in arrays.transform(df.select("pixels")).select("y__output").collect()]
    pixels = torch.tensor(np.array([r.pixels for r in df.select("pixels").collect()]), dtype=torch.float32)
    np.testing.assert_allclose(out, decoded.getModel()(pixels).detach().numpy().reshape(-1), rtol=1e-6)
    decoded.write().overwrite().save(str(tmp_path / "saved"))
    loaded = TorchModel.load(str(tmp_path / "saved"))
    assert set(loaded.getDecode()) == {"image"}
    assert [r.y__output for r in loaded.transform(images).select("y__output").collect()] == out
    loaded.setDecode(None)
    with pytest.raises(ValueError, match=r"^This TorchModel was fitted on the binary column 'image' decoded by decode=, "
                                         r"and has no decode for it now \(decode=None\); setDecode\(\{'image': fn\}\) "
                                         r"with the function it was fitted with.$"):
        loaded.transform(images)


def test_a_lightning_fit_takes_the_decoded_images(df, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from sparkhvd.ml import LightningEstimator

    class Brightness(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            assert batch["image"].dtype == torch.float32 and tuple(batch["image"].shape[1:]) == SHAPE
            return torch.nn.functional.mse_loss(self(batch["image"]).reshape(-1), batch["y"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    images = df.select("image", "y")
    model = LightningEstimator(num_proc=-1, store=Store.create(str(tmp_path / "store")), model=Brightness(),
                               feature_cols=["image"], label_cols=["y"], decode={"image": png}, batch_size=8, epochs=1,
                               random_seed=1, verbose=0).fit(images)
    out = [r.y__output for r in model.transform(images).select("y__output").collect()]
    assert len(out) == ROWS and all(np.isfinite(out))


# ---- mistakes fail before anything launches ----

def _fails(est, frame, match):
    with pytest.raises(ValueError, match=match):
        est.fit(frame)


def test_every_mistake_with_decode_fails_before_launch_with_one_sentence(df, tmp_path, rank_processes):
    _fails(_estimator(tmp_path, decode=None), df,
           r"^TorchEstimator.fit: the feature_cols column 'image' holds bytes \(binary\), which a model cannot take as "
           r"they are; pass decode=\{'image': fn\}, a function from a cell's bytes to a NumPy array of numbers, e.g. "
           r"decode=\{'image': lambda data: np.asarray\(PIL.Image.open\(io.BytesIO\(data\)\).convert\('RGB'\)\)\}, "
           r"or leave the column out.$")
    _fails(_estimator(tmp_path, decode={"image": png, "y": png}), df,
           r"^TorchEstimator.fit: decode names the column 'y', which is not a feature column \(feature_cols "
           r"\['image'\]\); decode turns a binary feature column into arrays, and labels stay numbers: add 'y' to "
           r"feature_cols, or drop it from decode.$")
    _fails(_estimator(tmp_path, feature="pixels", decode={"pixels": png}), df,
           r"^TorchEstimator.fit: decode names the feature column 'pixels', which has type array<array<array<bigint>>>, "
           r"not binary; decode turns bytes \(encoded images\) into arrays, and the estimator takes this column as it "
           r"is: drop 'pixels' from decode.$")
    _fails(_estimator(tmp_path, decode={"image": "png"}), df,
           r"^TorchEstimator.fit: decode must map feature column names to functions, got \{'image': 'png'\}; e.g. "
           r"decode=\{'image': lambda data: .*\}.$")
    _fails(_estimator(tmp_path, decode={"image": lambda data: np.load(io.BytesIO(data))}), df,
           r"^TorchEstimator.fit: decode\['image'\] fails on the first row's cell \(\d+ bytes\): (ValueError|"
           r"UnpicklingError): .*. Fix the function: it gets a cell's bytes and returns a NumPy array of numbers.$")
    _fails(_estimator(tmp_path, decode={"image": lambda data: Image.open(io.BytesIO(data)).format}), df,
           r"^TorchEstimator.fit: decode\['image'\] returned str 'PNG' for the first row's cell, not an array of "
           r"numbers; return a NumPy array of numbers, e.g. decode=\{'image': lambda data: .*\}.$")
    _fails(_estimator(tmp_path, label_cols=["image"], feature="pixels"), df,
           r"^TorchEstimator.fit: the label_cols column 'image' has type binary, which a model cannot take")
    assert rank_processes() == []
