"""ML persistence for the estimators and models: ``write().save(path)``, ``Cls.load(path)``, inside Pipelines too.

``path/metadata`` is Spark's own (``DefaultParamsWriter``: the class, the uid and the Params that
are plain JSON), so ``Pipeline`` and ``PipelineModel`` find the class and call its ``load``. The
rest goes beside it: the framework's own model file (``model.pt``, ``model.keras``), written by
the class's ``_save_artifacts``, and the Params that are Python objects (a loss function, a
Store, callbacks), cloudpickled into ``objects.pkl``. Loading unpickles that file: load only
what you (or someone you trust) saved, as with ``torch.load``.
"""

from __future__ import annotations

import json
import posixpath

import cloudpickle
import pyarrow.fs as pafs
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter

from ..data._metadata import resolve_url
from ._store import _as_url

OBJECTS = "objects.pkl"


def _plain(value) -> bool:
    try:
        return json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        return False


def location(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and directory of a save path (a local path or any URL the Store takes)."""
    return resolve_url(_as_url(path))


class Writer(MLWriter):
    """Saves an estimator or model: Spark's metadata, its framework's files, its object Params."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        fs, root = location(path)
        if fs.get_file_info(root).type != pafs.FileType.NotFound:
            raise FileExistsError(f"{path!r} already exists; save with {type(self.instance).__name__}.write()"
                                  ".overwrite().save(path) to replace it, or pick another path.")
        params = {param.name: value for param, value in self.instance._paramMap.items()}
        plain = {name: value for name, value in params.items() if _plain(value)}
        separate = hasattr(self.instance, "_save_model")  # a model's own file; an estimator's model (and the optimizer
        # holding its parameters) are pickled together, which keeps the optimizer pointing at those parameters
        objects = {name: value for name, value in params.items() if name not in plain and not (separate and name == "model")}
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession, paramMap=plain)
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(posixpath.join(root, OBJECTS)) as out:
            out.write(cloudpickle.dumps(objects))
        if separate and params.get("model") is not None:
            self.instance._save_model(params["model"], fs, root)


class Reader(MLReader):
    """Loads what ``Writer`` saved into an instance of ``cls``."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        fs, root = location(path)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        with fs.open_input_stream(posixpath.join(root, OBJECTS)) as f:
            objects = cloudpickle.loads(f.read())
        values = {**metadata["paramMap"], **objects}
        if hasattr(self.cls, "_load_model"):
            values["model"] = self.cls._load_model(fs, root)
        instance._set(**{name: value for name, value in values.items() if instance.hasParam(name)})
        if hasattr(instance, "_loaded_from"):
            instance._loaded_from(_as_url(path))
        return instance


class Persisted(MLReadable, MLWritable):
    """``write()`` and ``read()`` through Writer and Reader: the estimators' and models' ML persistence."""

    def write(self) -> Writer:
        return Writer(self)

    @classmethod
    def read(cls) -> Reader:
        return Reader(cls)
