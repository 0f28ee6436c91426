"""transform's executor side without Spark (the fast tier): Arrow columns in, the model's outputs out, as the UDF does.

- number, array and flattened tensor columns become float32 ``(rows, *shape)`` without a per-row loop; a null or a
  row of another length fails naming the column; a binary column goes through its decode function, whose arrays must
  have the fitted shape;
- one number per row comes back as doubles (rounded longs for an integer label), larger outputs as float arrays,
  several outputs as a struct; a model returning the wrong number of rows fails saying so;
- the model is loaded once per worker and device, and a task predicts on the GPU Spark assigned it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from sparkhvd.ml._columns import Column
from sparkhvd.ml._predict import Output, PredictSpec, device_for, from_numpy, loaded, predict_batches, to_numpy

pytestmark = pytest.mark.unit

SCALAR = Column("x", "scalar", False, 0, ())
TENSOR = Column("t", "array", False, 2, (2, 3))
IMAGE = Column("image", "decoded", False, 0, (2, 3), "binary")


def test_columns_become_float32_arrays_of_their_shape():
    np.testing.assert_array_equal(to_numpy(pa.array([1, 2, 3]), SCALAR, (1,)), [[1.0], [2.0], [3.0]])
    flat = pa.array([list(range(6)), list(range(6, 12))], type=pa.list_(pa.float32()))
    got = to_numpy(flat.slice(1, 1), TENSOR, (2, 3))  # a slice: offsets respected
    assert got.dtype == np.float32 and got.tolist() == [[[6, 7, 8], [9, 10, 11]]]
    with pytest.raises(ValueError, match=r"The feature column 't' has rows of 5 values where the model was fitted on "
                                         r"rows of shape \(2, 3\) \(6 values\)"):
        to_numpy(pa.array([list(range(5))], type=pa.list_(pa.float32())), TENSOR, (2, 3))
    with pytest.raises(ValueError, match=r"The feature column 'x' has 1 null rows in a batch; a model cannot take "
                                         r"nulls: fill them"):
        to_numpy(pa.array([1.0, None]), SCALAR, (1,))


def test_a_binary_column_is_decoded_into_float32_arrays_of_the_fitted_shape():
    cells = pa.array([bytes(range(6)), bytes(range(6, 12))], pa.binary())

    def decode(data: bytes) -> np.ndarray:
        assert isinstance(data, bytes)
        return np.frombuffer(data, np.uint8).reshape(2, 3)

    got = to_numpy(cells, IMAGE, (3, 2), decode)  # reshaped to the model's input shape, as on the ranks
    assert got.dtype == np.float32 and got.tolist() == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]]]
    with pytest.raises(ValueError, match=r"^decode\['image'\] returned an array of shape \(6,\) for a row, where the "
                                         r"model was fitted on rows of shape \(2, 3\); return that shape for every "
                                         r"cell \(resize in decode\), as in training.$"):
        to_numpy(cells, IMAGE, (2, 3), lambda data: np.frombuffer(data, np.uint8))


def test_outputs_become_the_prediction_columns():
    assert from_numpy(np.array([[0.5], [1.5]], dtype=np.float32), Output("y", True, False)).to_pylist() == [0.5, 1.5]
    assert from_numpy(np.array([[0.6], [2.4]]), Output("k", True, True)).to_pylist() == [1, 2]
    scores = from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3), Output("k", False, False))
    assert scores.type == pa.list_(pa.float32()) and scores.to_pylist() == [[0, 1, 2], [3, 4, 5]]


def _load_counting(calls: list):
    def load(source, blob, device):
        calls.append(device)
        return lambda inputs: [inputs[0].sum(axis=1, keepdims=True), inputs[0] * 2]
    return load


def test_batches_predicted_once_loaded_with_several_outputs_as_a_struct():
    calls: list = []
    spec = PredictSpec(key="k1", load=_load_counting(calls), source=None, blob=b"", features=(SCALAR,),
                       input_shapes=((1,),), outputs=(Output("a", True, False), Output("b", False, False)),
                       batch_size=2)
    batch = pa.StructArray.from_arrays([pa.array([1.0, 2.0, 3.0])], names=["x"])
    out = list(predict_batches(spec, iter([batch, batch])))
    assert out[0].to_pylist() == [{"a": 1.0, "b": [2.0]}, {"a": 2.0, "b": [4.0]}, {"a": 3.0, "b": [6.0]}]
    assert calls == ["cpu"]  # two batches, one load
    assert loaded(spec, "cpu") is loaded(spec, "cpu") and calls == ["cpu"]


def test_a_model_that_returns_other_rows_fails_saying_so():
    spec = PredictSpec(key="k2", load=lambda s, b, d: (lambda inputs: [inputs[0][:1]]), source=None, blob=b"",
                       features=(SCALAR,), input_shapes=((1,),), outputs=(Output("y__output", True, False),),
                       batch_size=10)
    batch = pa.StructArray.from_arrays([pa.array([1.0, 2.0])], names=["x"])
    with pytest.raises(ValueError, match=r"The model returned 1 rows of 'y__output' for 2 input rows"):
        list(predict_batches(spec, iter([batch])))


def test_a_task_predicts_on_the_gpu_spark_gave_it():
    assert device_for(["3"]) == "cuda:3"
    assert device_for(None) == device_for([]) == "cpu"


def test_a_model_built_without_a_fit_says_how_to_get_one():
    from sparkhvd.ml import TorchModel

    model = TorchModel(feature_columns=["x"], label_columns=["y"])
    assert model.getOutputCols() == ["y__output"] and model.getHistory() == []
    with pytest.raises(ValueError, match=r"^This TorchModel has no fitted model and column metadata to predict with; "
                                         r"get one from an estimator's fit\(df\), or TorchModel.load\(path\).$"):
        model._predict_spec()
