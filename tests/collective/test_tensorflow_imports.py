"""What importing sparkhvd's TensorFlow and Keras APIs gives, each in a fresh interpreter: the install hint without
TensorFlow, the core beneath them (not the torch API), Horovod's callbacks namespace and build flags."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")


def test_import_without_tensorflow_says_how_to_install_it():
    code = ("import sys\nsys.modules['tensorflow'] = None\n"
            "try:\n    import sparkhvd.collective.tensorflow\nexcept ModuleNotFoundError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert out.stdout.strip() == "TensorFlow isn't installed: pip install 'sparkhvd[tensorflow]'", out.stderr


@pytest.fixture(scope="module")
def imported() -> list:
    """What one fresh interpreter prints: the sparkhvd modules its TensorFlow and Keras APIs loaded (before anything
    imports the torch API), then whether Horovod's callbacks and timeline names are where Horovod has them, then the
    build flags. One interpreter for the three: importing TensorFlow is most of each one's time."""
    code = ("import sys, sparkhvd.collective.keras, sparkhvd.collective.tensorflow.keras\n"
            "print(sorted(m for m in sys.modules if m.startswith('sparkhvd.collective.')"
            " and m.split('.')[2] in ('torch', '_core')))\n"
            "import sparkhvd.collective.keras as k, sparkhvd.collective.tensorflow.keras as tk\n"
            "from sparkhvd.collective.tensorflow.keras.callbacks import MetricAverageCallback\n"
            "names = ['BroadcastGlobalVariablesCallback', 'MetricAverageCallback', 'LearningRateWarmupCallback', "
            "'LearningRateScheduleCallback', 'BestModelCheckpoint']\n"
            "print(all(getattr(k.callbacks, n) is getattr(k, n) is getattr(tk.callbacks, n) for n in names), "
            "MetricAverageCallback is k.MetricAverageCallback, tk.DistributedOptimizer is k.DistributedOptimizer)\n"
            "import sparkhvd.collective.tensorflow as t, sparkhvd.collective.torch as th\n"
            "print(k.start_timeline is t.start_timeline is th.start_timeline, k.stop_timeline is t.stop_timeline)\n"
            "names = ['mpi_enabled', 'mpi_built', 'gloo_enabled', 'gloo_built', 'nccl_built', 'ddl_built', "
            "'ccl_built', 'cuda_built', 'rocm_built']\n"
            "print([getattr(m, n)() for m in (t, k) for n in names])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4, out.stderr[-2000:]
    return lines


def test_tensorflow_and_keras_stand_on_the_core_not_on_the_torch_api(imported):
    loaded = imported[0]
    assert "sparkhvd.collective._core" in loaded and "sparkhvd.collective.torch" not in loaded


def test_keras_callbacks_namespace_as_in_horovod(imported):
    assert " ".join(imported[1:3]).split() == ["True"] * 5


def test_tensorflow_and_keras_export_horovods_build_flags(imported):
    mpi_built = importlib.util.find_spec("mpi4py") is not None  # the test extra installs it; MPI is not enabled
    assert imported[3] == str([False, mpi_built, True, True, 0, False, False, False, False] * 2)
