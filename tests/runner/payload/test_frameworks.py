"""Which frameworks a run's ranks will import (runner/_payload/frameworks.py): the warm process that forks them."""

from __future__ import annotations

import functools
import types

import pytest

from sparkhvd.runner._payload.frameworks import warm_imports
from sparkhvd.runner._payload.script import run_script

pytestmark = pytest.mark.unit

tf = types.ModuleType("tensorflow")  # stands for a notebook's top-level "import tensorflow as tf"; never imported


def _imports_tensorflow():
    import tensorflow  # noqa: F401


def _imports_horovod_keras_style():
    from sparkhvd.collective import keras as hvd  # noqa: F401


def _uses_the_global_tf():
    return tf.ones(3)


def _calls_a_helper_that_uses_tf():
    return _uses_the_global_tf()


def _nested():
    def inner():
        import keras  # noqa: F401
    return inner


def _torch_only(lr=0.1):
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    return torch.ones(1) * lr


def _closure():
    model = tf

    def train():
        return model

    return train


@pytest.mark.parametrize("fn", [_imports_tensorflow, _imports_horovod_keras_style, _uses_the_global_tf,
                                _calls_a_helper_that_uses_tf, _nested, _closure(),
                                functools.partial(_calls_a_helper_that_uses_tf)])
def test_a_function_that_names_tensorflow_or_keras_gets_the_tensorflow_warm_process(fn):
    assert warm_imports(fn, {}) == ("tensorflow",)


def test_a_torch_function_and_the_librarys_own_code_it_calls_do_not():
    assert warm_imports(_torch_only, {"lr": 0.2}) == ()
    assert warm_imports(print, {}) == ()


def test_a_keras_object_among_the_arguments_counts():
    Layer = type("Dense", (), {"__module__": "keras.src.layers.core.dense"})
    assert warm_imports(_torch_only, {"lr": Layer()}) == ("tensorflow",)
    assert warm_imports(_torch_only, {"lr": Layer}) == ("tensorflow",)


@pytest.mark.parametrize("source, preload", [
    ("import tensorflow as tf\n", ("tensorflow",)),
    ("import horovod.keras as hvd\n", ("tensorflow",)),
    ("from sparkhvd.collective import keras as hvd\n", ("tensorflow",)),
    ("def main():\n    from tensorflow import keras\n", ("tensorflow",)),
    ("import torch\nprint('keras')\n", ()),
    ("this is not python(", ()),
])
def test_a_scripts_imports_tell_it(source, preload):
    assert warm_imports(run_script, {"source": source, "path": "train.py", "argv": []}) == preload
