"""``import horovod.torch as hvd`` (and sparkdl's ``HorovodRunner``) resolved to sparkhvd where Horovod isn't installed.

Every rank sparkhvd starts installs this finder before it unpickles the training function
(runner/_rank/worker.py), so a Horovod script or function runs unmodified; on the driver,
``import sparkhvd.migrate`` installs it. The finder is APPENDED to ``sys.meta_path``: the import
system asks it only after the normal path finders found nothing, so a real ``horovod`` or
``sparkdl`` on ``sys.path`` always wins, and nothing under a real one is ever aliased.

Each aliased name is a module of its own (``horovod.torch``, ``repr`` "alias of
sparkhvd.collective.torch") holding the sparkhvd module's names, so ``hvd.init`` *is*
``sparkhvd.collective.torch.init``; a Horovod name sparkhvd lacks fails with a
``ModuleNotFoundError`` naming it and what to use instead. ``SPARKHVD_HOROVOD_ALIASES=0`` turns
the aliases off (docs/migration.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

from ..._common import settings

#: The Horovod release whose API the aliases follow (Horovod's ``horovod.__version__``).
HOROVOD_API_VERSION = "0.28.1"

_CORE = "sparkhvd.collective._core"

#: Horovod's and sparkdl's module names -> what stands in for each: a sparkhvd module (all its names),
#: ``{name: module}`` (just those names), or None (a package with nothing but its submodules).
ALIASES: dict = {
    "horovod": None,
    "horovod.torch": "sparkhvd.collective.torch",
    "horovod.torch.mpi_ops": "sparkhvd.collective.torch",
    "horovod.torch.compression": "sparkhvd.collective.torch._compression",
    "horovod.torch.functions": "sparkhvd.collective.torch._functions",
    "horovod.torch.optimizer": "sparkhvd.collective.torch._optimizer",
    "horovod.torch.sync_batch_norm": "sparkhvd.collective.torch._sync_batch_norm",
    "horovod.torch.elastic": "sparkhvd.collective.torch.elastic",
    "horovod.torch.elastic.sampler": "sparkhvd.collective.torch.elastic",
    "horovod.torch.elastic.state": "sparkhvd.collective.torch.elastic",
    "horovod.tensorflow": "sparkhvd.collective.tensorflow",
    "horovod.tensorflow.mpi_ops": "sparkhvd.collective.tensorflow",
    "horovod.tensorflow.compression": "sparkhvd.collective.tensorflow._compression",
    "horovod.tensorflow.functions": "sparkhvd.collective.tensorflow._functions",
    "horovod.tensorflow.sync_batch_norm": "sparkhvd.collective.tensorflow._sync_batch_norm",
    "horovod.tensorflow.elastic": "sparkhvd.collective.tensorflow.elastic",
    "horovod.tensorflow.util": "sparkhvd.collective.tensorflow.util",
    "horovod.tensorflow.keras": "sparkhvd.collective.keras",
    "horovod.tensorflow.keras.callbacks": "sparkhvd.collective.keras.callbacks",
    "horovod.tensorflow.keras.elastic": "sparkhvd.collective.keras.elastic",
    "horovod.keras": "sparkhvd.collective.keras",
    "horovod.keras.callbacks": "sparkhvd.collective.keras.callbacks",
    "horovod.keras.elastic": "sparkhvd.collective.keras.elastic",
    "horovod.common": None,
    "horovod.common.exceptions": {"HorovodInternalError": _CORE, "HostsUpdatedInterrupt": _CORE + "._elastic"},
    "horovod.common.process_sets": _CORE + "._process_sets",
    "horovod.common.elastic": _CORE + "._elastic",
    "horovod.spark": "sparkhvd.runner._dropins.horovod_spark",
    "horovod.spark.runner": "sparkhvd.runner._dropins.horovod_spark",
    # horovod.spark's Spark ML Estimators (named by string: the runner never imports sparkhvd.ml)
    "horovod.spark.torch": {"TorchEstimator": "sparkhvd.ml", "TorchModel": "sparkhvd.ml"},
    "horovod.spark.keras": {"KerasEstimator": "sparkhvd.ml", "KerasModel": "sparkhvd.ml"},
    "horovod.spark.lightning": {"LightningEstimator": "sparkhvd.ml", "LightningModel": "sparkhvd.ml"},
    "horovod.spark.common": None,
    "horovod.spark.common.store": {name: "sparkhvd.ml" for name in ("Store", "LocalStore", "HDFSStore",
                                                                    "DBFSLocalStore", "FilesystemStore")},
    "sparkdl": "sparkhvd.runner._dropins.sparkdl",
    "sparkdl.horovod": "sparkhvd.runner._dropins.sparkdl",
    "sparkdl.horovod.runner_base": "sparkhvd.runner._dropins.sparkdl",
    "sparkdl.horovod.tensorflow": None,
    "sparkdl.horovod.tensorflow.keras": "sparkhvd.runner._dropins.sparkdl_keras",
}

_TOPS = {"horovod": "Horovod", "sparkdl": "Databricks' sparkdl"}

#: What to use instead of a module that has no stand-in (the longest matching prefix wins).
_INSTEAD = {
    "horovod": "sparkhvd stands in for Horovod's torch, TensorFlow and Keras APIs, horovod.spark.run and its Estimators "
               "only; "
               "import a module the alias table in docs/migration.md lists",
    "horovod.mxnet": "sparkhvd has no MXNet API (torch, TensorFlow and Keras only)",
    "horovod.ray": "sparkhvd runs on Spark, not Ray: run the function with sparkhvd.HorovodRunner or "
                   "horovod.spark.run",
    "horovod.runner": "horovodrun's launcher has no stand-in: run the script with `sparkhvd run --np N train.py`, or "
                      "a function with sparkhvd.HorovodRunner(np).run(fn)",
    "horovod.spark": "of horovod.spark, sparkhvd has run(), the torch, keras and lightning Estimators and "
                     "common.store only: import those (docs/ml.md)",
    "horovod.tensorflow.data": "the tf.data service has no stand-in in sparkhvd; read the data with sparkhvd.data",
    "sparkdl": "sparkhvd stands in for sparkdl's HorovodRunner, sparkdl.horovod.log_to_driver and "
               "sparkdl.horovod.tensorflow.keras.LogCallback only",
}


def enabled() -> bool:
    """Whether the aliases are on (``SPARKHVD_HOROVOD_ALIASES`` is not "0")."""
    return settings.HOROVOD_ALIASES.get()


class HorovodAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``horovod.*`` and ``sparkdl.*`` where nothing else did, and loads what stands in for them."""

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in _TOPS:
            return None
        if name != top and not _ours(sys.modules.get(top)):
            return None  # under a real horovod / sparkdl: never ours
        if name not in ALIASES:
            if _instead(name) in _TOPS:  # nothing to say beyond Python's own error: answer as a finder does
                return None
            raise ModuleNotFoundError(_missing(name), name=name)  # a module users import: say what to use
        stand_in = ALIASES[name]
        origin = "alias of " + (stand_in if isinstance(stand_in, str) else "sparkhvd")
        return importlib.machinery.ModuleSpec(name, self, origin=origin, is_package=True)

    def create_module(self, spec):
        return None  # the default module; exec_module fills it

    def exec_module(self, module):
        stand_in = ALIASES[module.__name__]
        if stand_in is None:
            module.__doc__ = f"{module.__name__}, as sparkhvd stands in for it (docs/migration.md)."
            if module.__name__ == "horovod":
                module.__version__ = HOROVOD_API_VERSION
            module.__getattr__ = _Missing(module.__name__, None)
            return
        if isinstance(stand_in, str):
            real = importlib.import_module(stand_in)
            names = {k: v for k, v in vars(real).items() if k not in _IMPORT_SYSTEM}
        else:
            real = None
            names = {k: getattr(importlib.import_module(m), k) for k, m in stand_in.items()}
            names["__all__"] = list(stand_in)
        module.__dict__.update(names)
        module.__getattr__ = _Missing(module.__name__, real)


# Set by the import system for the alias itself; copying the stand-in's would make the alias claim its file.
_IMPORT_SYSTEM = frozenset({"__name__", "__spec__", "__loader__", "__path__", "__package__", "__file__", "__cached__",
                            "__builtins__", "__getattr__", "__dir__"})


class _Missing:
    """An alias's module ``__getattr__``: the stand-in's names added since (its submodules), else a clear error."""

    def __init__(self, alias: str, real):
        self.alias, self.real = alias, real

    def __call__(self, name: str):
        if self.real is not None and not name.startswith("__"):
            try:
                return getattr(self.real, name)
            except AttributeError:
                pass
        has = (f"{self.real.__name__}, which" if self.real is not None
               else "a package that holds only its submodules and")
        raise AttributeError(f"module {self.alias!r} has no attribute {name!r}: sparkhvd stands in for it with {has} "
                             "lacks it (docs/migration.md lists what sparkhvd stands in for).")


def _ours(module) -> bool:
    return isinstance(getattr(getattr(module, "__spec__", None), "loader", None), HorovodAliases)


def _instead(name: str) -> str:
    """The longest ``_INSTEAD`` entry that ``name`` is, or is under."""
    return max((p for p in _INSTEAD if name == p or name.startswith(p + ".")), key=len)


def _missing(name: str) -> str:
    top = name.partition(".")[0]
    return (f"No module named {name!r}: {_TOPS[top]} isn't installed here, and sparkhvd, which stands in for it, "
            f"has no {name}; {_INSTEAD[_instead(name)]}.")


def install() -> bool:
    """Append the finder to ``sys.meta_path`` unless the setting turns it off; returns whether it is installed."""
    if not enabled():
        return False
    if not any(isinstance(f, HorovodAliases) for f in sys.meta_path):
        sys.meta_path.append(HorovodAliases())
    return True


def uninstall() -> None:
    """Remove the finder and every alias module it made (tests; a driver that wants the names back)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, HorovodAliases)]
    for name in [n for n, m in list(sys.modules.items()) if _ours(m)]:
        del sys.modules[name]


def install_on_driver() -> bool:
    """``import sparkhvd.migrate``: install, and warn where the setting, or a real install, makes it a no-op."""
    if not install():
        name = settings.HOROVOD_ALIASES.name
        warnings.warn(f"{name}=0, so import sparkhvd.migrate installed no aliases: `import horovod...` and "
                      f"`from sparkdl import HorovodRunner` find only real installs; unset {name} to use "
                      "sparkhvd's.", RuntimeWarning, stacklevel=3)
        return False
    for top, what in _TOPS.items():
        if top in sys.modules and _ours(sys.modules[top]):
            continue
        found = importlib.machinery.PathFinder.find_spec(top)
        if found is not None:
            where = found.origin or ", ".join(found.submodule_search_locations or ()) or "sys.path"
            warnings.warn(f"{what} is installed here ({where}), so `import {top}...` keeps importing it, not "
                          f"sparkhvd; uninstall it (pip uninstall {top}) to run this code on sparkhvd.",
                          RuntimeWarning, stacklevel=3)
    return True
