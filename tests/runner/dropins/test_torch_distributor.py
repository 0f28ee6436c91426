"""``sparkhvd.TorchDistributor`` takes pyspark's arguments and refuses what pyspark's refuses, each with a sentence
that says the fix; it returns rank 0's value, runs scripts, and fails where a script fails (pyspark's returns
None there)."""

from __future__ import annotations

import logging

import pytest

from sparkhvd import HorovodRunError, TorchDistributor
from sparkhvd.runner._dropins import torch_distributor as _torch_distributor


class _Conf(dict):
    def __call__(self, key, default=None):
        return self.get(key, default)


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_num_processes_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=rf"^num_processes has to be a positive integer, got {bad!r}: the number of "
                                         r"training processes, e\.g\. TorchDistributor\(num_processes=2, "
                                         r"local_mode=False\)\.$"):
        TorchDistributor(num_processes=bad, use_gpu=False)


@pytest.mark.unit
def test_gpus_asked_for_but_not_configured_are_refused_as_pyspark_does(monkeypatch):
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: _Conf())
    with pytest.raises(RuntimeError, match=r"^'spark\.task\.resource\.gpu\.amount' was unset, so gpu usage is "
                                           r"unavailable: .* set spark\.task\.resource\.gpu\.amount=1 \(with "
                                           r"spark\.executor\.resource\.gpu\.amount and a discovery script\), or "
                                           r"pass use_gpu=False to train on CPUs\.$"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True)
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: _Conf({"spark.task.resource.gpu.amount": "0.5"}))
    with pytest.raises(RuntimeError, match=r"^'spark\.task\.resource\.gpu\.amount' is '0\.5', less than the whole GPU "
                                           r"each process needs: TorchDistributor\(use_gpu=True, local_mode=False\) "
                                           r"gives each process a GPU of its executor; set"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True)
    monkeypatch.setattr(_torch_distributor, "_driver_gpus", lambda: 0)
    with pytest.raises(RuntimeError, match=r"^GPUs were unable to be found on the driver: .* pass use_gpu=False to "
                                           r"train on CPUs\.$"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True)


@pytest.mark.unit
def test_more_processes_than_the_drivers_gpus_are_cut_down_on_pysparks_logger_not_as_a_warning(
        monkeypatch, caplog, pysparks, recwarn):
    theirs = pysparks({"spark.driver.resource.gpu.amount": "1"}, gpus=["0"], num_processes=2, local_mode=True,
                      use_gpu=True)
    assert theirs.logger.name == "TorchDistributor" and theirs.num_processes == 1
    (said,) = [r for r in caplog.records if r.name == "TorchDistributor"]
    assert said.levelno == logging.WARNING
    caplog.clear()
    monkeypatch.setattr(_torch_distributor, "_driver_gpus", lambda: 1)
    ours = TorchDistributor(num_processes=2, local_mode=True, use_gpu=True)
    assert ours.logger is logging.getLogger("TorchDistributor") and ours.num_processes == 1
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("TorchDistributor", logging.WARNING, "num_processes=2 is more than the 1 GPU on the driver; it was reset to "
                                              "1, as pyspark's TorchDistributor does; pass num_processes<=1, or give "
                                              "the driver more GPUs.")]
    assert not [w for w in recwarn if "num_processes" in str(w.message)]


@pytest.mark.unit
@pytest.mark.parametrize("num_processes, local_mode, use_gpu", [(2, False, False), (3, True, False), (2, False, True),
                                                                (3, True, True)])
def test_input_params_are_pysparks_keys_and_values(num_processes, local_mode, use_gpu, monkeypatch, pysparks):
    conf = {"spark.task.resource.gpu.amount": "1", "spark.driver.resource.gpu.amount": "2"}
    theirs = pysparks(conf, gpus=["0", "1"], num_processes=num_processes, local_mode=local_mode, use_gpu=use_gpu)
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: _Conf(conf))
    monkeypatch.setattr(_torch_distributor, "_driver_gpus", lambda: 2)
    ours = TorchDistributor(num_processes=num_processes, local_mode=local_mode, use_gpu=use_gpu)
    assert list(ours.input_params.items()) == list(theirs.input_params.items())
    assert ours.input_params == {"num_processes": 2 if use_gpu else num_processes, "local_mode": local_mode,
                                 "use_gpu": use_gpu, "num_tasks": 2 if use_gpu else num_processes}


@pytest.mark.unit
def test_a_task_of_k_gpus_runs_k_processes_and_num_processes_must_be_a_multiple_as_pysparks(monkeypatch, pysparks):
    conf = {"spark.task.resource.gpu.amount": "2"}
    theirs = pysparks(conf, gpus=["0", "1"], num_processes=4, local_mode=False, use_gpu=True)
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: _Conf(conf))
    ours = TorchDistributor(num_processes=4, local_mode=False, use_gpu=True)
    assert ours.num_tasks == theirs.num_tasks == 2
    assert ours.input_params == theirs.input_params
    with pytest.raises(RuntimeError) as pyspark_refusal:
        pysparks(conf, gpus=["0", "1"], num_processes=3, local_mode=False, use_gpu=True)
    with pytest.raises(RuntimeError) as refusal:
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=True)
    assert str(refusal.value) == (
        "TorchDistributor 'num_processes' value (3) must be a multiple of 'spark.task.resource.gpu.amount' (2) value: "
        "each Spark task holds 2 GPUs and runs a process on each; use num_processes=4 or 2.")
    assert str(refusal.value).startswith(str(pyspark_refusal.value).rstrip("."))  # pyspark's words, then the fix


@pytest.mark.unit
def test_a_cluster_that_encrypts_sparks_traffic_is_refused_unless_the_user_says_go_on(monkeypatch):
    conf = _Conf({"spark.network.crypto.enabled": "true"})
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: conf)
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    with pytest.raises(RuntimeError, match=r"^This cluster has encryption enabled \(spark\.network\.crypto\.enabled="
                                           r"true\); however, training does not support data encryption in transit: "
                                           r"TorchDistributor's processes would send model parameters and possibly "
                                           r"training data to each other unencrypted \(gloo and NCCL do not "
                                           r"encrypt\)\. To train anyway, set pytorch\.spark\.distributor\.ignoreSsl="
                                           r"true in the Spark configuration\.$"):
        distributor.run(print)
    conf["pytorch.spark.distributor.ignoreSsl"] = "true"
    with pytest.warns(RuntimeWarning, match=r"^This cluster has encryption enabled \(spark\.network\.crypto\.enabled="
                                            r"true\); however, training does not support data encryption in transit: "
                                            r".* going on because pytorch\.spark\.distributor\.ignoreSsl=true\.$"):
        distributor._check_encryption()


# What a user's code could match in pyspark's refusal and warning, whose lines break mid-phrase (textwrap.dedent)
_PYSPARKS_PHRASES = ("encryption enabled", "does not support data encryption in transit",
                     "model parameters and possibly training data", "unencrypted",
                     "pytorch.spark.distributor.ignoreSsl", "Spark configuration")


@pytest.mark.unit
def test_the_refusal_and_warning_where_spark_encrypts_say_pysparks_phrases(monkeypatch, pysparks, caplog):
    conf = {"spark.ssl.enabled": "true"}
    theirs = pysparks(conf, num_processes=2, local_mode=False, use_gpu=False)
    with pytest.raises(RuntimeError) as refused:
        theirs._check_encryption()
    monkeypatch.setattr(_torch_distributor, "_active_conf", lambda: _Conf(conf))
    with pytest.raises(RuntimeError) as ours:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._check_encryption()
    for phrase in _PYSPARKS_PHRASES:
        assert phrase in " ".join(str(refused.value).split()) and phrase in str(ours.value), phrase
    conf["pytorch.spark.distributor.ignoreSsl"] = "true"
    theirs._check_encryption()
    (said,) = [" ".join(r.getMessage().split()) for r in caplog.records if r.name == "TorchDistributor"]
    with pytest.warns(RuntimeWarning) as warned:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._check_encryption()
    for phrase in set(_PYSPARKS_PHRASES) - {"Spark configuration"}:  # ours ends "going on because <conf>=true"
        assert phrase in said and phrase in str(warned[0].message), phrase


@pytest.mark.unit
def test_a_script_takes_no_keyword_arguments_and_a_function_is_needed(monkeypatch):
    distributor = TorchDistributor(num_processes=1, use_gpu=False)
    with pytest.raises(ValueError, match=r"^Running pytorch file does not support key-word type arguments: got lr "
                                         r"for 'train\.py'; pass them as command-line strings, e\.g\. "
                                         r"run\('train\.py', '--lr', '0\.1'\)\.$"):
        distributor.run("train.py", lr=0.1)
    with pytest.raises(TypeError, match=r"^TorchDistributor\.run needs a function or the path of a Python script, "
                                        r"got int\.$"):
        distributor.run(3)


def _ranks_and_args(a, b, *, c):
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), (a, b, c), {k: os.environ[k] for k in ("LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                                                                   "CUDA_VISIBLE_DEVICES")}


def test_distributed_mode_returns_rank_zeros_value_with_one_node_per_task_and_no_gpu(spark, tmp_path):
    rank, args, env = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(_ranks_and_args, 1, 2,
                                                                                               c=3)
    assert (rank, args) == (0, (1, 2, 3))
    assert env == {"LOCAL_RANK": "0", "NODE_RANK": "0", "LOCAL_WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = tmp_path / "train.py"
    script.write_text("import sys\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1 and sys.argv[1:] == ['--fail']:\n    sys.exit(3)\n")
    assert TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(str(script), "--ok") is None
    with pytest.raises(HorovodRunError, match="rank 1"):  # pyspark's returns None where a script fails
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(str(script), "--fail")


@pytest.mark.unit
def test_horovodrunner_warns_where_spark_encrypts_its_traffic_and_goes_on():
    from sparkhvd.runner._backends import spark as _spark

    class _Sc:
        def __init__(self, conf):
            self.conf = _Conf(conf)

        def getConf(self):
            return self

        def get(self, key, default=None):
            return self.conf(key, default)

    _spark.warn_unencrypted(_Sc({}), "r1")  # nothing to say
    with pytest.warns(RuntimeWarning, match=r"^sparkhvd run r1: this cluster encrypts Spark's traffic "
                                            r"\(spark\.ssl\.enabled and spark\.network\.crypto\.enabled\), but the "
                                            r"ranks' gloo and NCCL traffic \(tensors, gradients, parameters\) is not "
                                            r"encrypted; run where the network between executors is trusted "
                                            r"\(docs/security\.md\)\.$"):
        _spark.warn_unencrypted(_Sc({"spark.ssl.enabled": "true", "spark.network.crypto.enabled": "TRUE"}), "r1")
