"""Zero-line migration: Horovod code and Databricks HorovodRunner notebooks run on sparkhvd unmodified.

Ranks resolve ``import horovod.torch as hvd`` (and TensorFlow, Keras, sparkdl) to sparkhvd; on the
driver, ``import sparkhvd.migrate`` does the same; ``horovod.spark.run`` runs on HorovodRunner. Real
processes, a real local Spark session; each run is shared by the assertions on it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd._common.settings import HOROVOD_ALIASES
from sparkhvd.runner._dropins.horovod_spark import _as_keywords
from sparkhvd.runner._dropins.horovod_spark import run as horovod_spark_run
from sparkhvd.runner._rank import aliases as _aliases

SPARKHVD = os.path.join(os.path.dirname(sys.executable), "sparkhvd")  # the console script beside this interpreter
LR = 0.01


@contextlib.contextmanager
def driver_aliases():
    """The driver's one line runs inside; afterwards this process has no alias left (other tests share it)."""
    sys.modules.pop("sparkhvd.migrate", None)
    try:
        yield
    finally:
        _aliases.uninstall()
        sys.modules.pop("sparkhvd.migrate", None)


def _batch(torch, rank):
    x = torch.arange(8.0).reshape(2, 4) + 1 + 8 * rank
    return x, x.sum(1, keepdim=True) / 10


def horovod_torch_step():
    """The shape of Horovod's examples/pytorch/pytorch_synthetic_benchmark.py, unmodified: one step."""
    import os
    import sys

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    from horovod.torch.elastic.sampler import ElasticSampler
    from horovod.torch.mpi_ops import synchronize  # Horovod's own test_adasum_pytorch.py imports it so

    hvd.init()
    torch.manual_seed(hvd.rank())  # every rank starts from other weights: the broadcast makes them rank 0's
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    x, y = _batch(torch, hvd.rank())
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    handle = hvd.allreduce_async(torch.arange(4.0) + 1 + 4 * hvd.rank(), op=hvd.Sum)
    try:
        import horovod.mxnet  # noqa: F401
        missing = None
    except ImportError as exc:
        missing = f"{type(exc).__name__}: {exc}"
    import sparkhvd.collective.torch as ours

    return {"rank": hvd.rank(), "size": hvd.size(), "weights": [p.detach().tolist() for p in model.parameters()],
            "sum": synchronize(handle).tolist(), "module": repr(hvd), "same": hvd.init is ours.init,
            "sampler": ElasticSampler is ours.elastic.ElasticSampler, "missing": missing,
            "finder": type(sys.meta_path[-1]).__name__, "warm": os.environ.get("SPARKHVD_WARM")}


def reference_weights(size=2):
    """One SGD step of lr*size on the gradient averaged over the ranks' batches, from rank 0's initial weights."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    grads = []
    for rank in range(size):
        model.zero_grad()
        x, y = _batch(torch, rank)
        F.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p -= LR * size * sum(g[i] for g in grads) / size
    return [p.detach().tolist() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------
# ranks: a function and a script, unmodified


@pytest.fixture(scope="module")
def torch_run():
    warm_process_serving()  # ranks forked from the warm process; the script's start fresh
    return HorovodRunner(np=-2).run_all(horovod_torch_step).values


def test_a_horovod_torch_function_runs_unmodified(torch_run):
    for rank, value in enumerate(torch_run):
        assert (value["rank"], value["size"]) == (rank, 2)
        assert value["sum"] == [6.0, 8.0, 10.0, 12.0]  # (arange(4)+1) + (arange(4)+5)


def test_horovod_torch_is_an_alias_of_sparkhvds_torch_api(torch_run):
    for value in torch_run:
        assert value["module"] == "<module 'horovod.torch' (alias of sparkhvd.collective.torch)>"
        assert value["same"] and value["sampler"]


def test_the_alias_finder_comes_after_the_path_finders(torch_run):
    assert [value["finder"] for value in torch_run] == ["HorovodAliases"] * 2  # appended: the path finders first


def test_the_ranks_of_a_function_are_forked_from_the_warm_process(torch_run):
    # forked from the warm process, which imported runner/_rank/worker.py
    assert [value["warm"] for value in torch_run] == ["forked"] * 2


def test_the_unmodified_training_step_matches_the_reference(torch_run):
    import torch

    assert torch_run[0]["weights"] == torch_run[1]["weights"]
    for got, want in zip(torch_run[0]["weights"], reference_weights()):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))


def test_a_horovod_name_sparkhvd_lacks_fails_naming_it(torch_run):
    assert torch_run[0]["missing"] == (
        "ModuleNotFoundError: No module named 'horovod.mxnet': Horovod isn't installed here, and sparkhvd, which "
        "stands in for it, has no horovod.mxnet; sparkhvd has no MXNet API (torch, TensorFlow and Keras only).")


HOROVOD_SCRIPT = """
    import os

    import torch
    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.arange(8.0).reshape(2, 4) + 1 + 8 * hvd.rank()
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) / 10).backward()
    optimizer.step()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    print("RESULT", hvd.rank(), hvd.size(), total, os.environ["SPARKHVD_WARM"], model.weight.flatten().tolist(),
          flush=True)
"""


def test_a_horovodrun_script_runs_unmodified_under_sparkhvd_run(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(HOROVOD_SCRIPT))
    env = dict(os.environ, SPARKHVD_WARM="0")  # fresh rank processes: python -m sparkhvd.runner._rank.worker
    out = subprocess.run([SPARKHVD, "run", "--np", "-2", "train.py"], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    import torch

    results = sorted(line.split(" ", 6)[1:] for line in out.stdout.splitlines() if line[4:].startswith("RESULT "))
    assert [r[:5] for r in results] == [["RESULT", "0", "2", "3.0", "0"], ["RESULT", "1", "2", "3.0", "0"]], out.stdout
    assert results[0][5] == results[1][5]  # the same weights on both ranks
    torch.testing.assert_close(torch.tensor(ast.literal_eval(results[0][5])), torch.tensor(reference_weights()[0][0]))


# ---------------------------------------------------------------------------------------------
# ranks: TensorFlow and Keras, in one run (importing TensorFlow costs seconds per process)


def horovod_tensorflow_and_keras():
    import horovod.keras
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import keras
    import numpy as np
    import tensorflow as tf
    from horovod.tensorflow.keras.callbacks import MetricAverageCallback
    from sparkdl.horovod.tensorflow.keras import LogCallback

    try:
        from horovod.tensorflow.data.compute_service import TfDataServiceConfig  # noqa: F401
        missing = None
    except ImportError as exc:
        missing = str(exc)
    hvd.init()
    total = hvd.allreduce(tf.constant([1.0, 2.0]) * (hvd.rank() + 1), op=hvd.Sum).numpy().tolist()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, kernel_initializer=keras.initializers.RandomNormal(seed=hvd_keras.rank()))])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x = np.arange(32, dtype="float32").reshape(8, 4) / 32 + hvd_keras.rank()
    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), MetricAverageCallback()]
    model.fit(x, x.sum(1), batch_size=4, epochs=1, verbose=0,
              callbacks=callbacks + ([LogCallback()] if hvd_keras.rank() == 0 else []))
    return {"sum": total, "weights": [w.tolist() for w in model.get_weights()],
            "keras_alike": horovod.keras.DistributedOptimizer is hvd_keras.DistributedOptimizer,
            "modules": [repr(hvd), repr(hvd_keras)], "missing": missing}


@pytest.fixture(scope="module")
def tf_run():
    if importlib.util.find_spec("tensorflow") is None:  # found, not imported: the driver needs no TensorFlow
        pytest.skip("TensorFlow isn't installed: pip install 'sparkhvd[tensorflow]'")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        values = HorovodRunner(np=-2).run_all(horovod_tensorflow_and_keras).values
    return values, shown.getvalue()


def test_horovod_tensorflow_and_keras_code_runs_unmodified(tf_run):
    values, _ = tf_run
    for value in values:
        assert value["sum"] == [3.0, 6.0]
        assert value["keras_alike"]
        assert value["modules"] == ["<module 'horovod.tensorflow' (alias of sparkhvd.collective.tensorflow)>",
                                    "<module 'horovod.tensorflow.keras' (alias of sparkhvd.collective.keras)>"]


def test_unmodified_keras_training_gives_every_rank_the_same_weights(tf_run):
    values, _ = tf_run
    assert values[0]["weights"] == values[1]["weights"]  # broadcast from rank 0, then the same averaged steps


def test_a_horovod_tensorflow_module_sparkhvd_lacks_is_named_with_the_fix(tf_run):
    values, _ = tf_run
    assert values[0]["missing"] == (
        "No module named 'horovod.tensorflow.data': Horovod isn't installed here, and sparkhvd, which stands in for "
        "it, has no horovod.tensorflow.data; the tf.data service has no stand-in in sparkhvd; read the data with "
        "sparkhvd.data.")


def test_sparkdls_log_callback_reaches_the_driver(tf_run):
    _, shown = tf_run
    assert "[0] Epoch 1/1\n" in shown  # sparkdl's LogCallback, through log_to_driver
    assert "[0] Epoch 1 done in " in shown


# ---------------------------------------------------------------------------------------------
# the driver: a Databricks notebook with its one line

NOTEBOOK_CELL = """
import sparkhvd.migrate  # the one line
from sparkdl import HorovodRunner
from sparkdl.horovod import log_to_driver
import horovod.torch as hvd_on_driver  # a cell that imports horovod on the driver: main refers to it

def main(lr):
    import os
    import torch
    import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    print(f"rank {hvd.rank()} of {hvd.size()} at lr {lr}")
    log_to_driver(f"logged by rank {hvd.rank()}")
    weights = [p.detach().tolist() for p in model.parameters()]
    return hvd_on_driver.allgather_object((hvd.rank(), weights, os.environ.get("SPARKHVD_WARM")))

result = HorovodRunner(np=-2, driver_log_verbosity="all").run(main, lr=0.1)
"""


def warm_process_serving():
    """Start this session's warm process (runner/_warm/server.py) unless one serves, and return once it answers."""
    from sparkhvd.runner._warm import client as _warm_client
    from sparkhvd.runner._warm.key import zygote_key

    key = zygote_key()
    _warm_client.start_server(key)  # exits at once where one already holds the key
    deadline = time.monotonic() + 60.0  # not a timed assertion: how long to wait for its answer
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, _warm_client.WarmUnavailable):
            sock = _warm_client.connect(key, timeout=5.0)
            try:
                if _warm_client.request(sock, {"ping": True}):
                    return
            finally:
                sock.close()
        time.sleep(0.2)
    raise AssertionError(f"no warm process answered for key {key} within 60 s")


@pytest.fixture(scope="module")
def notebook_run():
    warm_process_serving()
    cell = {"__name__": "__main__"}  # as in a notebook: main is pickled by value
    shown = io.StringIO()
    with driver_aliases(), contextlib.redirect_stdout(shown):
        exec(compile(NOTEBOOK_CELL, "<notebook cell>", "exec"), cell)
    return cell["result"], shown.getvalue()


def test_a_databricks_notebook_runs_with_one_line(notebook_run):
    result, shown = notebook_run
    assert [(rank, warm) for rank, _, warm in result] == [(0, "forked"), (1, "forked")]
    assert result[0][1] == result[1][1]  # rank 0's weights, broadcast
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} of 2 at lr 0.1\n" in shown  # np<0: every rank's output, as on Databricks
        assert f"[{rank}] logged by rank {rank}\n" in shown


def test_the_one_line_leaves_nothing_behind_when_undone(notebook_run):
    assert not any(isinstance(f, _aliases.HorovodAliases) for f in sys.meta_path)
    assert not [name for name in sys.modules if name.split(".")[0] in ("horovod", "sparkdl")]


def test_sparkdl_log_verbosity_keeps_databricks_meaning():
    from sparkhvd.runner._dropins.sparkdl import HorovodRunner as SparkdlRunner

    assert SparkdlRunner(np=2)._runner.config.driver_log_verbosity == "log_callback_only"  # Databricks' default
    assert SparkdlRunner(np=-2)._runner.config.driver_log_verbosity == "all"  # np<0: the ranks' output in the cell
    with pytest.raises(ValueError, match=r"^driver_log_verbosity='loud' is not one of sparkdl's 'all', "
                                         r"'log_callback_only'; pass 'all'"):
        SparkdlRunner(np=2, driver_log_verbosity="loud")
    with pytest.raises(TypeError):
        SparkdlRunner(2)  # keyword-only, as Databricks'


# ---------------------------------------------------------------------------------------------
# the driver: aliases in this process


@pytest.fixture
def aliases():
    with driver_aliases():
        assert _aliases.install()
        yield


def test_the_aliases_are_sparkhvd_modules(aliases):
    import horovod
    import horovod.common.exceptions
    import horovod.spark
    import horovod.torch as hvd
    import horovod.torch.elastic

    import sparkhvd.collective._core as core
    import sparkhvd.collective.torch as ours
    import sparkhvd.runner

    assert horovod.__version__ == _aliases.HOROVOD_API_VERSION
    assert horovod.spark.run is sparkhvd.runner.horovod_spark_run is horovod_spark_run
    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    import sparkhvd.ml

    assert (TorchEstimator, Store) == (sparkhvd.ml.TorchEstimator, sparkhvd.ml.Store)
    assert (hvd.init, hvd.allreduce, hvd.DistributedOptimizer) == (ours.init, ours.allreduce, ours.DistributedOptimizer)
    assert horovod.torch.elastic.TorchState is ours.elastic.TorchState
    assert horovod.common.exceptions.HorovodInternalError is core.HorovodInternalError
    assert horovod.common.exceptions.__all__ == ["HorovodInternalError", "HostsUpdatedInterrupt"]
    with pytest.raises(AttributeError, match=r"^module 'horovod.torch' has no attribute 'nope': sparkhvd stands in "
                                             r"for it with sparkhvd.collective.torch, which lacks it"):
        hvd.nope
    with pytest.raises(AttributeError, match=r"^module 'horovod' has no attribute 'run': sparkhvd stands in for it "
                                             r"with a package that holds only its submodules and lacks it"):
        horovod.run


@pytest.mark.unit
@pytest.mark.parametrize("name", ["horovod.torch.mpi_lib_v2", "horovod.common.basics", "sparkdl.xgboost"])
def test_another_name_is_simply_not_found_as_a_finder_answers(aliases, name):
    assert importlib.util.find_spec(name) is None  # a probe gets None, not an exception
    with pytest.raises(ModuleNotFoundError, match=rf"^No module named '{name}'$"):
        importlib.import_module(name)


@pytest.mark.parametrize("name, instead", [
    ("horovod.spark.tensorflow", "of horovod.spark, sparkhvd has run(), the torch, keras and lightning Estimators"),
    ("horovod.runner", "horovodrun's launcher has no stand-in: run the script with `sparkhvd run"),
    ("horovod.ray", "sparkhvd runs on Spark, not Ray"),
    ("horovod.mxnet", "sparkhvd has no MXNet API"),
])
@pytest.mark.unit
def test_a_name_without_a_stand_in_fails_naming_it(aliases, name, instead):
    top = "Horovod" if name.startswith("horovod") else "Databricks' sparkdl"
    with pytest.raises(ModuleNotFoundError, match=rf"^No module named '{name}': {top} isn't installed here, and "
                                                  rf"sparkhvd, which stands in for it, has no {name}; ") as caught:
        importlib.import_module(name)
    assert instead in str(caught.value) and caught.value.name == name


FAKE_PACKAGES = {"horovod/__init__.py": "MARK = 'real horovod'\n", "horovod/torch/__init__.py": "MARK = 'real torch'\n",
                 "sparkdl/__init__.py": "MARK = 'real sparkdl'\n"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A folder with a stand-in for a real horovod and sparkdl install."""
    root = tmp_path_factory.mktemp("site")
    for rel, text in FAKE_PACKAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_real_horovod_and_sparkdl_win_on_the_driver(installed, monkeypatch):
    monkeypatch.syspath_prepend(str(installed))
    with driver_aliases():
        with pytest.warns(RuntimeWarning) as said:
            import sparkhvd.migrate  # noqa: F401
        import horovod.torch
        import sparkdl

        assert (horovod.MARK, horovod.torch.MARK, sparkdl.MARK) == ("real horovod", "real torch", "real sparkdl")
        with pytest.raises(ModuleNotFoundError, match=r"^No module named 'horovod.spark'$"):
            import horovod.spark  # under a real horovod, nothing is aliased
        for module in ("horovod", "sparkdl", "horovod.torch"):
            sys.modules.pop(module)
    assert [str(w.message).split(" (")[0] for w in said] == ["Horovod is installed here", "Databricks' sparkdl is "
                                                                                          "installed here"]
    assert "so `import horovod...` keeps importing it, not sparkhvd; uninstall it (pip uninstall horovod)" in str(
        said[0].message)


@pytest.mark.unit
def test_the_setting_turns_the_one_line_off(monkeypatch):
    monkeypatch.setenv(HOROVOD_ALIASES.name, "0")
    with driver_aliases():
        with pytest.warns(RuntimeWarning, match=r"^SPARKHVD_HOROVOD_ALIASES=0, so import sparkhvd.migrate installed "
                                                r"no aliases"):
            import sparkhvd.migrate  # noqa: F401
        with pytest.raises(ModuleNotFoundError, match=r"^No module named 'horovod'$"):
            import horovod  # noqa: F401


# ---------------------------------------------------------------------------------------------
# ranks: a real install wins; the setting turns the aliases off


def imports_horovod():
    import horovod.torch
    import sparkdl

    return horovod.MARK, horovod.torch.MARK, sparkdl.MARK


def test_a_real_horovod_and_sparkdl_win_on_the_ranks(installed, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(installed))  # the ranks' sys.path
    monkeypatch.setenv("SPARKHVD_WARM", "0")  # no warm process for this one-off environment
    assert HorovodRunner(np=-1).run(imports_horovod) == ("real horovod", "real torch", "real sparkdl")


def test_the_setting_turns_the_aliases_off_on_the_ranks(monkeypatch):
    monkeypatch.setenv(HOROVOD_ALIASES.name, "0")
    with pytest.raises(HorovodRunError, match=r"ModuleNotFoundError: No module named 'horovod'\n"):
        HorovodRunner(np=-1).run(imports_horovod)


def test_the_drivers_setting_reaches_spark_executors(spark, monkeypatch):
    monkeypatch.setenv(HOROVOD_ALIASES.name, "0")  # set after the executors started: the run forwards it
    with pytest.raises(HorovodRunError, match=r"ModuleNotFoundError: No module named 'horovod'\n"):
        HorovodRunner(np=1).run(imports_horovod)


# ---------------------------------------------------------------------------------------------
# horovod.spark.run


def hello(magic, scale=1):
    import os

    import horovod.torch as hvd
    import torch

    hvd.init()
    print(f"hello from rank {hvd.rank()}", flush=True)
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    return hvd.rank(), hvd.size(), magic * scale, total, os.environ.get("MIGRATION_MARK")


def every_rank(*values):
    import horovod.torch as hvd

    hvd.init()
    return hvd.rank(), values


@pytest.fixture(scope="module")
def spark_runs(spark):
    shown = io.StringIO()
    with driver_aliases():
        import sparkhvd.migrate  # noqa: F401 - the one line
        # isort: split
        import horovod.spark

        values = horovod.spark.run(hello, args=(42,), kwargs={"scale": 2}, num_proc=2, env={"MIGRATION_MARK": "set"},
                                   stdout=shown, stderr=sys.stderr, verbose=2, prefix_output_with_timestamp=True)
        from sparkdl import HorovodRunner as SparkdlRunner

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            every_slot = SparkdlRunner(np=0).run(hello, magic=1)
    return values, shown.getvalue(), every_slot, [str(w.message) for w in said if w.category is FutureWarning]


def test_horovod_spark_run_returns_every_ranks_value(spark_runs):
    values, shown, _, _ = spark_runs
    assert values == [(0, 2, 84, 3.0, "set"), (1, 2, 84, 3.0, "set")]
    assert "[0] hello from rank 0\n" in shown and "[1] hello from rank 1\n" in shown  # stdout=


def test_sparkdl_np_0_runs_on_every_task_slot(spark_runs, spark):
    _, _, every_slot, said = spark_runs
    assert every_slot == (0, 2, 1, 3.0, None)
    assert said == [f"HorovodRunner(np=0) is deprecated (by Databricks too): it runs np=2, every task slot "
                    f"{spark.sparkContext.master} has now; pass np=2 to say so."]


def test_positional_only_arguments_still_reach_fn():
    main, keywords = _as_keywords(every_rank, (1, 2), {})
    assert keywords == {} and main.__name__ == "every_rank"
    assert HorovodRunner(np=-1).run(main) == (0, (1, 2))
    assert _as_keywords(hello, (42,), {"scale": 2}) == (hello, {"magic": 42, "scale": 2})


@pytest.mark.parametrize("kwargs, message", [
    ({"use_mpi": True}, r"use_mpi=True: sparkhvd never uses MPI .*; drop use_mpi\.$"),
    ({"extra_mpi_args": "-x NCCL_DEBUG"}, r"extra_mpi_args='-x NCCL_DEBUG': sparkhvd never runs mpirun; drop "),
    ({"executable": "/opt/other/python"}, r"executable='/opt/other/python': sparkhvd starts each rank with the "
                                          r"Python the Spark executors run; set spark.pyspark.python"),
    ({"stderr": io.StringIO()}, r"stderr=<_io.StringIO .*>: sparkhvd shows each rank's stdout and stderr together"),
])
def test_horovod_spark_run_refuses_what_cannot_apply(kwargs, message):
    with pytest.raises(ValueError, match=r"^horovod.spark.run on sparkhvd cannot apply " + message):
        horovod_spark_run(hello, args=(1,), num_proc=2, **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_proc": 0}, ValueError, r"^num_proc=0 must be a whole number >= 1: how many Spark tasks"),
    ({"num_proc": -2}, ValueError, r"^num_proc=-2 must be a whole number >= 1: .*HorovodRunner\(np=-N\)"),
    ({"num_proc": 2, "nics": ["eth0", "eth1"]}, ValueError,
     r"^nics=\['eth0', 'eth1'\]: sparkhvd's ranks talk over one network interface; .* nics=\['eth0'\]\.$"),
    ({"num_proc": 2, "env": {"N": 1}}, TypeError, r"^env=\{'N': 1\} must map environment variable names to string"),
    ({"num_proc": 2, "args": (1, 2, 3)}, TypeError,
     r"^horovod.spark.run cannot call hello\(magic, scale=1\) with args=\(1, 2, 3\) and kwargs=\{\}: too many "),
    ({"num_proc": 2, "fn": "train.py"}, TypeError, r"^horovod.spark.run needs a function to run, got str"),
])
@pytest.mark.unit
def test_horovod_spark_run_checks_its_arguments(kwargs, error, message):
    kwargs = {"fn": hello, "args": (1,), **kwargs}
    with pytest.raises(error, match=message):
        horovod_spark_run(**kwargs)


@pytest.mark.unit
def test_horovod_spark_start_timeout_is_read_as_horovod_does(monkeypatch):
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"^HOROVOD_SPARK_START_TIMEOUT='soon' is not a number of seconds; set it "
                                         r"to e.g. 600, or pass start_timeout=\.$"):
        horovod_spark_run(hello, args=(1,), num_proc=2)


def test_without_a_spark_context_the_defaults_that_need_one_say_so():
    code = textwrap.dedent("""
        from sparkhvd.runner._dropins.horovod_spark import run
        from sparkhvd.runner._dropins.sparkdl import HorovodRunner
        for call in (lambda: run(lambda: 1), lambda: HorovodRunner(np=0).run(lambda: 1)):
            try:
                call()
            except ValueError as exc:
                print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == [
        "horovod.spark.run(num_proc=None) runs spark.default.parallelism ranks of the active SparkContext, and there "
        "is none; start a SparkSession first, or pass num_proc=N.",
        "HorovodRunner(np=0) runs one rank per task slot of the active SparkContext, and there is none; start a "
        "SparkSession first, or pass np=N (np=-N for N processes on the driver).",
    ], out.stderr
