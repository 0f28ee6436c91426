"""TensorFlow's own distributed training under sparkhvd: ``MultiWorkerMirroredStrategy`` built from the
``TF_CONFIG`` every rank gets trains a custom loop with the same weights on both workers of HorovodRunner(np=2),
and the ``MirroredStrategyRunner`` drop-in (runner/_dropins/mirrored_strategy_runner.py) runs it as
spark-tensorflow-distributor does, with its strategy or the function's own, on Spark or on the driver. Its checks
and the way it maps onto HorovodRunner are unit tests against a fake runner and a fake Spark configuration."""

from __future__ import annotations

import importlib.util
import re
import warnings

import cloudpickle
import pytest

from sparkhvd import HorovodRunner, MirroredStrategyRunner
from sparkhvd.runner import _horovod_runner
from sparkhvd.runner._dropins import mirrored_strategy_runner as msr
from sparkhvd.runner._runner_config import RunnerConfig

needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow isn't installed")


# ---- on the ranks -----------------------------------------------------------------------------------------------

def _train(strategy, worker, steps):
    """A few steps of a custom training loop (``strategy.run`` in a tf.function, ``apply_gradients``) on data of
    this worker's own; the weights before and after, and after on every worker (gathered through the strategy)."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(learning_rate=0.1)
        optimizer.build(model.trainable_variables)
    before = [w.tolist() for w in model.get_weights()]
    x = tf.random.stateless_normal((8, 3), seed=(worker, 1))  # each worker's batch differs
    y = tf.reduce_sum(x * [1.0, -2.0, 0.5], axis=1, keepdims=True)

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica)

    @tf.function
    def every_worker():
        flat = strategy.run(lambda: tf.concat([tf.reshape(v, [1, -1]) for v in model.trainable_variables], axis=1))
        return strategy.gather(flat, axis=0)

    for _ in range(steps):
        step()
    return before, [w.tolist() for w in model.get_weights()], every_worker().numpy().tolist()


def _report(strategy, worker, steps):
    import json
    import os

    import tensorflow as tf

    before, after, every = _train(strategy, worker, steps)
    return {"replicas": strategy.num_replicas_in_sync, "strategy": type(strategy).__name__,
            "tf_config": json.loads(os.environ.get("TF_CONFIG", "null")), "before": before, "after": after,
            "every_worker": every,
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpus": len(tf.config.list_physical_devices("GPU"))}


def _own_strategy(steps):
    """The function builds its strategy from TF_CONFIG itself (use_custom_strategy=True, or HorovodRunner)."""
    import json
    import os

    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return _report(strategy, json.loads(os.environ["TF_CONFIG"])["task"]["index"], steps)


def _runners_strategy(steps, early=None):
    """Plain TensorFlow code: the strategy is the one MirroredStrategyRunner's scope gives. ``early``: unpickled
    before the strategy starts (``_TensorOnArrival``)."""
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    worker = strategy.cluster_resolver.task_id or 0
    return {**_report(strategy, worker, steps), "in_scope": tf.distribute.has_strategy()}


class _TensorOnArrival:
    """Unpickles on the rank into a tensor, which starts TensorFlow's context before the runner's strategy (as an
    argument that is a tensor does): the strategy works only because the runner resets that context first."""

    def __reduce__(self):
        return _tensor, ()


def _tensor():
    import tensorflow as tf

    return tf.constant(1.0)


def _trained_in_sync(report, workers):
    every = report["every_worker"]
    assert len(every) == workers and all(row == every[0] for row in every)  # identical on every worker
    flat_before = [v for w in report["before"] for v in _flat(w)]
    assert every[0] == _flat(report["after"]) != flat_before  # this worker's own weights, trained


def _flat(value):
    return [x for item in value for x in _flat(item)] if isinstance(value, list) else [value]


# ---- through Spark (local[2]) -----------------------------------------------------------------------------------

@needs_tf
def test_multi_worker_mirrored_strategy_from_the_runners_tf_config_trains_both_ranks_alike(spark, rank_processes):
    ranks = HorovodRunner(np=2).run_all(_own_strategy, steps=3).values
    workers = [r["tf_config"]["cluster"]["worker"] for r in ranks]
    assert workers[0] == workers[1] and len(set(workers[0])) == 2
    assert [r["tf_config"]["task"] for r in ranks] == [{"type": "worker", "index": i} for i in range(2)]
    for r in ranks:
        assert r["replicas"] == 2
        _trained_in_sync(r, 2)
    assert ranks[0]["after"] == ranks[1]["after"]  # each rank's own final weights, as run_all returns them
    assert rank_processes() == []


@needs_tf
def test_mirrored_strategy_runner_with_the_functions_own_strategy_returns_the_chiefs_value(spark):
    chief = MirroredStrategyRunner(num_slots=2, local_mode=False, use_gpu=False,
                                   use_custom_strategy=True).run(_own_strategy, steps=2)
    assert chief["tf_config"]["task"] == {"type": "worker", "index": 0} and chief["replicas"] == 2
    assert (chief["cuda"], chief["gpus"]) == ("", 0)  # use_gpu=False: no GPU to see
    _trained_in_sync(chief, 2)


@needs_tf
def test_mirrored_strategy_runner_runs_plain_code_inside_its_multi_worker_strategy(spark):
    chief = MirroredStrategyRunner(num_slots=2, use_gpu=False).run(_runners_strategy, steps=2,
                                                                   early=_TensorOnArrival())
    assert chief["in_scope"] and chief["strategy"] == "CollectiveAllReduceStrategy"  # MultiWorkerMirroredStrategy
    assert chief["replicas"] == 2 and chief["tf_config"]["task"]["index"] == 0
    _trained_in_sync(chief, 2)


@needs_tf
def test_mirrored_strategy_runner_in_local_mode_is_one_worker_on_the_driver_without_tf_config():
    report = MirroredStrategyRunner(num_slots=1, local_mode=True, use_gpu=False).run(_runners_strategy, steps=2)
    assert report["in_scope"] and report["strategy"] == "CollectiveAllReduceStrategy"
    assert report["replicas"] == 1 and report["tf_config"] is None and (report["cuda"], report["gpus"]) == ("", 0)
    _trained_in_sync(report, 1)


# ---- its checks and its mapping onto HorovodRunner (no process, no Spark) ---------------------------------------

class _FakeRunner:
    """Stands in for HorovodRunner: keeps what the drop-in made of its arguments, returns the chief's value."""

    made: list = []

    def __init__(self, config: RunnerConfig):
        self.config = config
        self.main = self.kwargs = None
        _FakeRunner.made.append(self)

    @classmethod
    def _from_config(cls, config: RunnerConfig):
        return cls(config)

    def run(self, main, **kwargs):
        self.main, self.kwargs = main, kwargs
        return "the chief's value"


@pytest.fixture
def conf(monkeypatch):
    """The active session's Spark configuration, faked: a dict."""
    values = {}
    monkeypatch.setattr(msr, "_active_conf", lambda: values.get)
    return values


@pytest.fixture
def fake_runner(monkeypatch):
    _FakeRunner.made = []
    monkeypatch.setattr(_horovod_runner, "HorovodRunner", _FakeRunner)
    return _FakeRunner.made


def _add(x, y=0):
    return x + y


def _devices():
    import os

    return os.environ["CUDA_VISIBLE_DEVICES"]


@pytest.mark.unit
@pytest.mark.parametrize("num_slots", ["2", 2.0, True, None])
def test_num_slots_that_is_not_a_whole_number_is_refused(num_slots, conf):
    message = (f"num_slots has to be a whole number, got {num_slots!r} ({type(num_slots).__name__}): the number of "
               "GPUs, or of CPU workers, to train on, e.g. MirroredStrategyRunner(num_slots=2).")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=num_slots, use_gpu=False)


@pytest.mark.unit
@pytest.mark.parametrize("num_slots", [0, -1])
def test_num_slots_of_zero_or_less_is_refused_as_theirs_does(num_slots, conf):
    message = (f"num_slots is set to {num_slots} but cannot be less than or equal to 0; pass the number of GPUs, or "
               "of CPU workers, to train on, e.g. MirroredStrategyRunner(num_slots=2).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=num_slots)


@pytest.mark.unit
def test_num_slots_is_keyword_only_as_theirs(conf):
    with pytest.raises(TypeError):
        MirroredStrategyRunner(2)


@pytest.mark.unit
def test_gpu_training_on_spark_needs_gpu_scheduling(conf, monkeypatch):
    monkeypatch.setattr(msr, "_active_conf", lambda: None)
    message = ("The conf `spark.task.resource.gpu.amount` was not found in the Spark configuration (no SparkSession "
               "is active), so the cluster "
               "might not have Spark GPU-aware scheduling enabled: MirroredStrategyRunner(use_gpu=True, "
               "local_mode=False) gives each worker a GPU of its executor; start the SparkSession with "
               "spark.task.resource.gpu.amount=1 (and spark.executor.resource.gpu.amount with a discovery script), "
               "or pass use_gpu=False to train on CPUs.")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=2)
    monkeypatch.setattr(msr, "_active_conf", lambda: conf.get)
    with pytest.raises(RuntimeError, match=re.escape("was not found in the active SparkSession's configuration, so")):
        MirroredStrategyRunner(num_slots=2)


@pytest.mark.unit
@pytest.mark.parametrize("amount", ["0.5", "0", "many"])
def test_a_gpu_amount_below_one_per_task_is_refused(amount, conf):
    conf["spark.task.resource.gpu.amount"] = amount
    message = (f"The Spark conf `spark.task.resource.gpu.amount` has a value of {amount} but it should not have a "
               "value less than 1: each worker needs a whole GPU; set spark.task.resource.gpu.amount=1, or pass "
               "use_gpu=False to train on CPUs.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=4)


@pytest.mark.unit
@pytest.mark.parametrize("amount, num_slots, tasks", [("1", 4, 4), ("2", 4, 2), ("2", 3, 2), ("4", 3, 1)])
def test_a_task_of_k_gpus_is_one_worker_as_theirs_packs_them(amount, num_slots, tasks, conf):
    conf["spark.task.resource.gpu.amount"] = amount  # theirs: ceil(num_slots / amount) workers of amount GPUs
    assert MirroredStrategyRunner(num_slots=num_slots).get_num_tasks() == tasks


@pytest.mark.unit
def test_another_gpu_resource_name_is_refused_outside_local_mode(conf):
    conf["spark.task.resource.gpu.amount"] = "1"
    message = ("gpu_resource_name='nvidia.com/gpu', but sparkhvd's tasks ask Spark for the resource named 'gpu'; "
               "name the GPU resource 'gpu' in the Spark configuration (spark.executor.resource.gpu.amount, "
               "spark.task.resource.gpu.amount), or pass use_gpu=False to train on CPUs.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=2, gpu_resource_name="nvidia.com/gpu")
    assert MirroredStrategyRunner(num_slots=2, gpu_resource_name="nvidia.com/gpu", use_gpu=False).get_num_tasks() == 2
    assert MirroredStrategyRunner(num_slots=2, gpu_resource_name="nvidia.com/gpu", local_mode=True)._num_tasks is None


@pytest.mark.unit
def test_run_needs_a_function(conf, fake_runner):
    message = "MirroredStrategyRunner.run needs a function to run, got str; pass the training function, e.g. " \
              "run(train, epochs=3)."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=2, use_gpu=False).run("train.py")
    assert fake_runner == []


@pytest.mark.unit
def test_local_mode_on_the_cpu_is_one_worker(conf, fake_runner):
    message = ("Cannot run with more than 1 CPU machine in local mode: num_slots=2 with use_gpu=False; pass "
               "num_slots=1, or local_mode=False to train on num_slots Spark tasks.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=2, local_mode=True, use_gpu=False).run(_add, x=1)
    assert fake_runner == []


@pytest.mark.unit
def test_local_mode_on_gpus_needs_the_drivers_spark_gpus(conf, fake_runner, monkeypatch):
    monkeypatch.setattr(msr, "_driver_gpu_addresses", lambda name: None)
    message = ("The provided GPU resource name `acc` was not found in the driver's Spark resources, and "
               "MirroredStrategyRunner(local_mode=True, use_gpu=True) trains on those; start the SparkSession with "
               "spark.driver.resource.acc.amount and spark.driver.resource.acc.discoveryScript, or pass "
               "use_gpu=False to train on the CPU.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=1, local_mode=True, gpu_resource_name="acc").run(_add, x=1)

    monkeypatch.setattr(msr, "_driver_gpu_addresses", lambda name: ["0", "01"])
    message = ("Found GPU addresses ['0', '01'] which are not all in the correct format for CUDA_VISIBLE_DEVICES, "
               "which requires integers with no zero padding; make spark.driver.resource.gpu.discoveryScript print "
               'indices such as {"name": "gpu", "addresses": ["0", "1"]}.')
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=1, local_mode=True).run(_add, x=1)

    monkeypatch.setattr(msr, "_driver_gpu_addresses", lambda name: ["0", "1"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    message = ("3 slots were requested for local training with GPU training but only 2 GPUs were available on the "
               "driver (0, 1); use num_slots<=2, or local_mode=False to train on the cluster's GPUs.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=3, local_mode=True).run(_add, x=1)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    message = ("Spark gave the driver GPU addresses ['0', '1'], but its CUDA_VISIBLE_DEVICES='7' lists 1 device, "
               "which 1 cannot index; make spark.driver.resource.gpu.discoveryScript print indices into that list, "
               "or unset CUDA_VISIBLE_DEVICES.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        MirroredStrategyRunner(num_slots=1, local_mode=True).run(_add, x=1)
    assert fake_runner == []


@pytest.mark.unit
def test_local_mode_on_gpus_picks_num_slots_of_the_drivers_gpus_through_its_cuda_visible_devices(
        conf, fake_runner, monkeypatch):
    monkeypatch.setattr(msr, "_driver_gpu_addresses", lambda name: ["0", "1", "2"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13")
    assert MirroredStrategyRunner(num_slots=2, local_mode=True, use_custom_strategy=True).run(_devices) == \
        "the chief's value"
    (runner,) = fake_runner
    assert runner.config.np == -1 and runner.config.use_gpu
    chosen = runner.main().split(",")  # on the rank
    assert len(set(chosen)) == 2 and set(chosen) <= {"10", "11", "12"}


@pytest.mark.unit
def test_an_encrypted_cluster_is_refused_unless_ignore_ssl_is_set(conf, fake_runner):
    conf["spark.ssl.enabled"] = "true"
    runner = MirroredStrategyRunner(num_slots=2, use_gpu=False)
    message = ("This cluster has encryption enabled (spark.ssl.enabled=true); however, training does not support "
               "data encryption in transit: MirroredStrategyRunner's workers would send model parameters and possibly "
               "training data to each other unencrypted (TensorFlow's collectives do not encrypt). To train anyway, "
               "set tensorflow.spark.distributor.ignoreSsl=true in the Spark configuration.")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        runner.run(_add, x=1)
    assert fake_runner == []
    conf["tensorflow.spark.distributor.ignoreSsl"] = "True"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert runner.run(_add, x=1) == "the chief's value"
    assert [str(w.message) for w in caught] == [
        "This cluster has encryption enabled (spark.ssl.enabled=true); however, training does not support data "
        "encryption in transit: MirroredStrategyRunner's workers send model parameters and possibly training data "
        "to each other unencrypted (TensorFlow's collectives do not encrypt); going on because "
        "tensorflow.spark.distributor.ignoreSsl=true."]


@pytest.mark.unit
@pytest.mark.parametrize("use_gpu", [True, False])
def test_each_worker_is_a_task_with_its_own_gpu_and_the_wrapper_travels_to_the_ranks(use_gpu, conf, fake_runner):
    conf["spark.task.resource.gpu.amount"] = "1"
    assert MirroredStrategyRunner(num_slots=3, use_gpu=use_gpu).run(_add, x=1, y=2) == "the chief's value"
    (runner,) = fake_runner
    assert (runner.config.np, runner.config.layout, runner.config.use_gpu) == (3, "node_per_task", use_gpu)
    assert runner.kwargs == {"x": 1, "y": 2}
    # HorovodRunner ships the user's module (this one) by value, found through the function's __module__
    assert (runner.main.__module__, runner.main.__name__, runner.main.__wrapped__) == (__name__, "_add", _add)


@pytest.mark.unit
def test_the_wrapper_runs_the_function_as_given_with_its_own_strategy_and_without_tf_config_in_local_mode(
        conf, fake_runner, monkeypatch):
    def seen(x):
        import os

        return x, os.environ.get("TF_CONFIG"), os.environ.get("CUDA_VISIBLE_DEVICES")

    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    MirroredStrategyRunner(num_slots=2, use_gpu=False, use_custom_strategy=True).run(seen, x=1)
    MirroredStrategyRunner(num_slots=1, local_mode=True, use_gpu=False, use_custom_strategy=True).run(seen, x=2)
    distributed, local = (cloudpickle.loads(cloudpickle.dumps(r.main)) for r in fake_runner)
    assert distributed(x=1) == (1, "{}", "0,1")  # what HorovodRunner gave the rank
    assert local(x=2) == (2, None, "0,1")
    monkeypatch.setattr(msr, "_driver_gpu_addresses", lambda name: ["0", "1"])
    MirroredStrategyRunner(num_slots=1, local_mode=True, use_custom_strategy=True).run(seen, x=3)
    assert cloudpickle.loads(cloudpickle.dumps(fake_runner[-1].main))(x=3) in [(3, None, "0"), (3, None, "1")]
