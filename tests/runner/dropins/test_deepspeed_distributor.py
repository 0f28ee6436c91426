"""``sparkhvd.DeepspeedTorchDistributor`` takes pyspark's arguments, keeps pyspark's ``input_params``, refuses bad
ones with a sentence that says the fix, and gives each process ``--deepspeed --deepspeed_config <path>``, a dict's
file lasting as long as the process's function or script. Its real runs: tests/frameworks/test_frameworks_deepspeed.py.
"""

from __future__ import annotations

import json
import os

import pytest

from sparkhvd import DeepspeedTorchDistributor
from sparkhvd.runner._dropins import deepspeed_distributor as _deepspeed
from sparkhvd.runner._dropins import torch_distributor as _torch_distributor

pytestmark = pytest.mark.unit

CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


class _Conf(dict):
    def __call__(self, key, default=None):
        return self.get(key, default)


@pytest.mark.parametrize("num_gpus, nnodes, local_mode, use_gpu, config", [
    (2, 1, True, False, None), (1, 3, False, False, CONFIG), (2, 2, False, True, "ds_config.json"),
    (3, 1, True, True, CONFIG)])  # the driver's 2 GPUs: 3 processes are cut down to 2, by both
def test_input_params_are_pysparks_keys_order_and_values(num_gpus, nnodes, local_mode, use_gpu, config,
                                                          monkeypatch, pysparks):
    conf = {"spark.task.resource.gpu.amount": "1", "spark.driver.resource.gpu.amount": "2"}
    theirs = pysparks(conf, gpus=["0", "1"], name="DeepspeedTorchDistributor", numGpus=num_gpus, nnodes=nnodes,
                      localMode=local_mode, useGpu=use_gpu, deepspeedConfig=config)
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: _Conf(conf))
    monkeypatch.setattr(_torch_distributor, "_driver_gpus", lambda: 2)
    ours = DeepspeedTorchDistributor(numGpus=num_gpus, nnodes=nnodes, localMode=local_mode, useGpu=use_gpu,
                                     deepspeedConfig=config)
    assert list(ours.input_params.items()) == list(theirs.input_params.items())
    processes = min(num_gpus * nnodes, 2) if use_gpu and local_mode else num_gpus * nnodes
    assert list(ours.input_params.items()) == [("deepspeed_config", config), ("num_processes", processes),
                                               ("local_mode", local_mode), ("use_gpu", use_gpu),
                                               ("num_tasks", processes)]
    assert (ours.deepspeed_config, ours.cleanup_deepspeed_conf, ours.ssl_conf) == (
        theirs.deepspeed_config, theirs.cleanup_deepspeed_conf, theirs.ssl_conf)


@pytest.mark.parametrize("name, bad", [("numGpus", 0), ("numGpus", "two"), ("numGpus", True), ("nnodes", -1),
                                       ("nnodes", 1.5)])
def test_gpus_and_nodes_must_be_positive_integers(name, bad):
    with pytest.raises(ValueError, match=rf"^{name} has to be a positive integer, got {bad!r}: "
                                         r"DeepspeedTorchDistributor runs numGpus processes on each of nnodes nodes, "
                                         r"e\.g\. DeepspeedTorchDistributor\(numGpus=2, nnodes=1\)\.$"):
        DeepspeedTorchDistributor(**{name: bad}, useGpu=False)


def test_a_configuration_is_a_dict_a_path_or_none():
    with pytest.raises(TypeError, match=r"^deepspeedConfig has to be a dict, the path of a JSON file or None, got "
                                        r"int; pass e\.g\. deepspeedConfig=\{'train_batch_size': 8\}\.$"):
        DeepspeedTorchDistributor(useGpu=False, deepspeedConfig=3)
    with pytest.raises(TypeError, match=r"^deepspeedConfig has to be JSON, which each process writes to the file it "
                                        r"gives DeepSpeed, but Object of type set is not JSON serializable; use "
                                        r"numbers, strings, lists and dicts only\.$"):
        DeepspeedTorchDistributor(useGpu=False, deepspeedConfig={"optimizer": {"params": {"betas": {0.9, 0.99}}}})


def test_a_script_takes_no_keyword_arguments_and_a_function_is_needed():
    distributor = DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig=CONFIG)
    with pytest.raises(ValueError, match=r"^DeepspeedTorchDistributor with pytorch file doesn't support keyword "
                                         r"arguments: got epochs, lr for 'train\.py'; pass them as command-line "
                                         r"strings, e\.g\. run\('train\.py', '--lr', '0\.1'\)\.$"):
        distributor.run("train.py", lr=0.1, epochs=2)
    with pytest.raises(TypeError, match=r"^DeepspeedTorchDistributor\.run needs a function or the path of a Python "
                                        r"script, got int\.$"):
        distributor.run(3)


def test_a_cluster_that_encrypts_sparks_traffic_is_refused_unless_deepspeeds_setting_says_go_on(monkeypatch,
                                                                                                 pysparks):
    conf = {"spark.ssl.enabled": "true"}
    theirs = pysparks(conf, name="DeepspeedTorchDistributor", numGpus=2, localMode=False, useGpu=False)
    with pytest.raises(RuntimeError, match="deepspeed.spark.distributor.ignoreSsl"):
        theirs._check_encryption()
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: _Conf(conf))
    distributor = DeepspeedTorchDistributor(numGpus=2, localMode=False, useGpu=False)
    with pytest.raises(RuntimeError, match=r"^This cluster has encryption enabled \(spark\.ssl\.enabled=true\); "
                                           r"however, training does not support data encryption in transit: "
                                           r"DeepspeedTorchDistributor's processes would send model parameters and "
                                           r"possibly training data to each other unencrypted \(gloo and NCCL do not "
                                           r"encrypt\)\. To train anyway, set deepspeed\.spark\.distributor\.ignoreSsl"
                                           r"=true in the Spark configuration\.$"):
        distributor.run(print)
    conf["deepspeed.spark.distributor.ignoreSsl"] = "true"
    with pytest.warns(RuntimeWarning, match=r"going on because deepspeed\.spark\.distributor\.ignoreSsl=true\.$"):
        distributor._check_encryption()


def test_each_process_gets_deepspeeds_arguments_and_a_dicts_file_lasts_as_long_as_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with _deepspeed._deepspeed_argv(None) as tail:
        assert tail == ["--deepspeed"]
    with _deepspeed._deepspeed_argv("/shared/ds_config.json") as tail:
        assert tail == ["--deepspeed", "--deepspeed_config", "/shared/ds_config.json"]
    with _deepspeed._deepspeed_argv(tmp_path / "ds.json") as tail:  # a path object, as a string
        assert tail == ["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")]
    with _deepspeed._deepspeed_argv(CONFIG) as tail:
        flag, option, path = tail
        assert (flag, option) == ("--deepspeed", "--deepspeed_config")
        folder = os.path.dirname(path)
        assert os.path.dirname(folder) == str(tmp_path) and os.path.basename(folder).startswith("sparkhvd-deepspeed-")
        with open(path, encoding="utf-8") as f:
            assert json.load(f) == CONFIG
    assert not os.path.exists(folder)
    with pytest.raises(KeyError), _deepspeed._deepspeed_argv(CONFIG) as tail:  # a function or script that fails
        raise KeyError(tail[2])
    assert os.listdir(tmp_path) == []
