"""What every fitted model shares: ``transform`` through ``_predict.py``, ML persistence, ``getHistory``.

The executors load the model from a file: the one ``fit`` wrote into the run's directory (its
own, named by its content, which a later fit of the run never replaces), or the one ``save`` wrote
(``load`` points there). A model with no file (built by hand, or given
another model with ``setModel``) travels inside the Spark job instead, which Spark caps at 2 GB;
save it to lift the cap.
"""

from __future__ import annotations

import uuid

import cloudpickle
from pyspark.ml import Model

from ._columns import Column, numel
from ._params import ModelParams
from ._persistence import Persisted
from ._predict import Output, PredictSpec, transform


class HorovodModel(Model, ModelParams, Persisted):
    """A fitted model; a framework subclass supplies its file format and its executor-side loader."""

    _model_file_name = ""
    _load_for_predict = None  # staticmethod load(source, blob, device) -> predict, in the subclass

    def __init__(self, **kwargs):
        super().__init__()
        self._file: tuple[int, str] | None = None  # (id of the model object, the URL of its file)
        self._key = uuid.uuid4().hex
        self._set_keywords(kwargs)

    def _use_file(self, url: str) -> None:
        """The executors load the current model from ``url``, which holds exactly it and never changes."""
        self._file = (id(self.getModel()), url)

    def _loaded_from(self, path_url: str) -> None:
        self._use_file(f"{path_url}/{self._model_file_name}")

    def setModel(self, value):
        self._key = uuid.uuid4().hex  # a new model: the workers' cached one is stale
        return self._set(model=value)

    def _model_source(self) -> tuple[str | None, bytes | None]:
        model = self.getModel()
        if self._file is not None and self._file[0] == id(model):
            return self._file[1], None
        return None, self._serialize(model)

    def _serialize(self, model) -> bytes:
        raise NotImplementedError

    def _input_shapes(self, features) -> tuple:
        return tuple(column.shape or (1,) for column in features)

    def _predict_spec(self, batch_size: int = 1024) -> PredictSpec:
        if not self.isDefined(self._metadata) or self.getModel() is None:
            raise ValueError(f"This {type(self).__name__} has no fitted model and column metadata to predict with; "
                             f"get one from an estimator's fit(df), or {type(self).__name__}.load(path).")
        meta = self.getOrDefault(self._metadata)
        features = tuple(Column.from_dict(d) for d in meta["features"])
        labels = [Column.from_dict(d) for d in meta["labels"]]
        outputs = []
        for name, label, shape in zip(self.getOutputCols(), labels, meta["output_shapes"]):
            scalar = numel(tuple(shape)) == 1
            outputs.append(Output(name, scalar=scalar, integer=scalar and label.integer))
        decode = self.getDecode() or {}
        missing = [c.name for c in features if c.kind == "decoded" and not callable(decode.get(c.name))]
        if missing:
            raise ValueError(f"This {type(self).__name__} was fitted on the binary column {missing[0]!r} decoded by "
                             f"decode=, and has no decode for it now (decode={self.getDecode()!r}); "
                             f"setDecode({{{missing[0]!r}: fn}}) with the function it was fitted with.")
        source, blob = self._model_source()
        return PredictSpec(key=self._key, load=type(self)._load_for_predict, source=source, blob=blob,
                           features=features, input_shapes=self._input_shapes(features), outputs=tuple(outputs),
                           batch_size=batch_size, decode=cloudpickle.dumps(dict(decode)) if decode else None)

    def _transform(self, df):
        spec = self._predict_spec()
        labels = [Column.from_dict(d) for d in self.getOrDefault(self._metadata)["labels"]]
        vectors = tuple(output.name for output, label in zip(spec.outputs, labels)
                        if label.kind == "vector" and not output.scalar)
        return transform(df, spec, vectors)
