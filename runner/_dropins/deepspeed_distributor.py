"""pyspark's ``DeepspeedTorchDistributor``, run by sparkhvd: ``from sparkhvd import DeepspeedTorchDistributor`` is
the only change (pyspark's is ``pyspark.ml.deepspeed.deepspeed_distributor``).

A ``TorchDistributor`` (runner/_dropins/torch_distributor.py) of ``numGpus * nnodes`` processes, as pyspark's:

- ``DeepspeedTorchDistributor(numGpus=1, nnodes=1, localMode=True, useGpu=True, deepspeedConfig=None)``;
  ``localMode`` and ``useGpu`` mean what TorchDistributor's ``local_mode`` and ``use_gpu`` do.
- ``run("train.py", *args)`` runs the script with ``args`` and then ``--deepspeed`` and, where there is a
  configuration, ``--deepspeed_config <path>``: the arguments ``deepspeed.add_config_arguments`` parses.
- ``run(fn, *args, **kwargs)`` runs the function on every process and returns rank 0's value. As in pyspark's, the
  function is not given the configuration, but ``sys.argv`` ends with the same arguments while it runs (pyspark runs
  it from a generated script given them), so ``parser.parse_args()`` finds them there.
- A configuration given as a dict is written to a JSON file in a new folder of each process's temp folder, removed
  when the function or script ends; pyspark writes it to a temp file where it starts torchrun (the driver in local
  mode, each Spark task otherwise) and leaves it there. A path is passed as it is: it must exist where the processes
  run, as in pyspark's.
- Where Spark encrypts its traffic, it refuses unless ``deepspeed.spark.distributor.ignoreSsl`` is ``true``.
- ``input_params``: pyspark's dict, ``deepspeed_config`` first, then TorchDistributor's keys.
"""

from __future__ import annotations

import contextlib
import functools
import json
import numbers
import os
import sys
import tempfile

from .._backends.spark import refuse_unencrypted
from .._payload.function import pickle_function
from .._payload.payload import loads
from .._payload.script import as_payload, run_script
from . import torch_distributor as _torch
from .torch_distributor import TorchDistributor

__all__ = ["DeepspeedTorchDistributor"]

_SSL_CONF = "deepspeed.spark.distributor.ignoreSsl"
_FOLDER_PREFIX = "sparkhvd-deepspeed-"  # each process's folder for a dict configuration, under its temp folder


class DeepspeedTorchDistributor(TorchDistributor):
    """``DeepspeedTorchDistributor(numGpus=1, nnodes=1, localMode=True, useGpu=True, deepspeedConfig=None)``, with
    pyspark's meaning (above).

    Raises:
        ValueError: ``numGpus`` or ``nnodes`` is not a positive integer.
        TypeError: ``deepspeedConfig`` is not a dict, a path or None, or is a dict that is not JSON.
        RuntimeError: what TorchDistributor raises where the GPUs asked for are not there.
    """

    def __init__(self, numGpus: int = 1, nnodes: int = 1, localMode: bool = True, useGpu: bool = True,
                 deepspeedConfig: dict | str | os.PathLike | None = None):
        for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"{name} has to be a positive integer, got {value!r}: DeepspeedTorchDistributor runs "
                                 "numGpus processes on each of nnodes nodes, e.g. DeepspeedTorchDistributor(numGpus=2, "
                                 "nnodes=1).")
        if deepspeedConfig is not None and not isinstance(deepspeedConfig, (dict, str, os.PathLike)):
            raise TypeError(f"deepspeedConfig has to be a dict, the path of a JSON file or None, got "
                            f"{type(deepspeedConfig).__name__}; pass e.g. deepspeedConfig={{'train_batch_size': 8}}.")
        if isinstance(deepspeedConfig, dict):  # each process writes it as JSON: refused here, not in every process
            try:
                json.dumps(deepspeedConfig)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"deepspeedConfig has to be JSON, which each process writes to the file it gives "
                                f"DeepSpeed, but {exc}; use numbers, strings, lists and dicts only.") from exc
        self.deepspeed_config = deepspeedConfig  # as given, as pyspark keeps it
        super().__init__(int(numGpus) * int(nnodes), localMode, useGpu, _ssl_conf=_SSL_CONF)
        # pyspark's _create_input_params: deepspeed_config is set before TorchDistributor's attributes
        self.input_params = {"deepspeed_config": self.deepspeed_config, **self.input_params}
        self.cleanup_deepspeed_conf = False  # pyspark's attribute, which nothing reads there either

    def run(self, train_object, *args, **kwargs):
        """Run ``train_object(*args, **kwargs)`` on every process and return rank 0's value, or run the script
        ``train_object`` with ``args``, ``--deepspeed`` and the configuration's ``--deepspeed_config``.

        Raises:
            ValueError: a script given keyword arguments; or the script cannot be read or compiled.
            TypeError: ``train_object`` is neither a function nor a path, or a script's argument is not a string.
            RuntimeError: where Spark encrypts its traffic and ``deepspeed.spark.distributor.ignoreSsl`` is not true.
            HorovodRunError: a process failed (the function raised, or the script exited with another status than 0).
        """
        if isinstance(train_object, (str, os.PathLike)):
            if kwargs:
                raise ValueError(f"DeepspeedTorchDistributor with pytorch file doesn't support keyword arguments: got "
                                 f"{', '.join(sorted(kwargs))} for {os.fspath(train_object)!r}; pass them as "
                                 "command-line strings, e.g. run('train.py', '--lr', '0.1').")
            _, script = as_payload(train_object, args, {})  # read and compiled here, on the driver
            return super().run(functools.partial(_script_on_rank, self.deepspeed_config, script))
        if not callable(train_object):
            raise TypeError(f"DeepspeedTorchDistributor.run needs a function or the path of a Python script, got "
                            f"{type(train_object).__name__}.")
        # Pickled here, as HorovodRunner pickles a function (the user's own module by value), and unpickled in the
        # rank inside _function_on_rank: HorovodRunner would look at the wrapper's module, which is ours.
        pickled = pickle_function(functools.partial(train_object, *args) if args else train_object, kwargs)
        return super().run(functools.partial(_function_on_rank, self.deepspeed_config, pickled))

    def _check_encryption(self) -> None:
        """Refuse, as pyspark's does, where Spark encrypts its traffic and the user has not said to go on."""
        refuse_unencrypted(_torch._active_conf(), self.ssl_conf, "DeepspeedTorchDistributor's processes",
                           "gloo and NCCL")


@contextlib.contextmanager
def _deepspeed_argv(config):
    """On a rank: the arguments pyspark's gives a script, ``--deepspeed`` and, for a configuration,
    ``--deepspeed_config <path>``; a dict is written to a JSON file that lasts as long as the ``with``."""
    if config is None:
        yield ["--deepspeed"]
        return
    if not isinstance(config, dict):
        yield ["--deepspeed", "--deepspeed_config", os.fspath(config)]
        return
    with tempfile.TemporaryDirectory(prefix=_FOLDER_PREFIX) as folder:
        path = os.path.join(folder, "deepspeed_config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        yield ["--deepspeed", "--deepspeed_config", path]


def _script_on_rank(config, script: dict) -> None:
    """On a rank: the shipped script (``as_payload``'s), its arguments followed by ``_deepspeed_argv``'s."""
    with _deepspeed_argv(config) as tail:
        return run_script(**{**script, "argv": [*script["argv"], *tail]})


def _function_on_rank(config, pickled: bytes):
    """On a rank: the function ``pickle_function`` pickled, with ``sys.argv`` ending with ``_deepspeed_argv``'s, as
    pyspark's."""
    fn, kwargs = loads(pickled)
    with _deepspeed_argv(config) as tail:
        saved = sys.argv
        sys.argv = [*saved[:1], *tail]
        try:
            return fn(**kwargs)
        finally:
            sys.argv = saved
