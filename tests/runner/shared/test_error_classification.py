"""Errors are classified by type, and by text only in runner/_shared/error_text.py's ``read_text``: one test for each
pattern it matches, with the text each source really gives (gloo's from torch 2.13, TensorFlow's, Spark's)."""

from __future__ import annotations

import doctest

import pytest

from sparkhvd.runner._shared import collateral as _collateral
from sparkhvd.runner._shared import error_text as _error_text
from sparkhvd.runner._shared.error_text import PEER_GONE, SPARK_STOPPED, WRAPPED, Reading, read_text

pytestmark = pytest.mark.unit

# What a gloo collective raised in the survivor when its peer's process died (torch 2.13.0, two processes on
# 127.0.0.1; SIGKILL and os._exit): a plain RuntimeError, no DistError subclass.
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:22923. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF! 🏖️")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:52902: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️")


@pytest.mark.parametrize("pattern, message", [
    ("Connection reset by peer", GLOO_RESET),
    ("Connection closed by peer", GLOO_CLOSED),
    ("Broken pipe", "[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Write error [127.0.0.1]:4242: Broken pipe"),
    ("GLHF", "Timed out waiting for the peer to connect. GLHF!"),
    ("pair.cc", "[../third_party/gloo/gloo/transport/tcp/pair.cc:211] some other transport failure"),
])
def test_each_gloo_pattern_says_a_peer_is_gone_in_a_runtime_error_only(pattern, message):
    assert read_text("RuntimeError", message) == (Reading(PEER_GONE, pattern),)
    assert _collateral.is_collateral("RuntimeError", message)
    assert read_text("OSError", message) == ()  # a user's own error of another type is its own cause
    assert not _collateral.is_collateral("ConnectionResetError", message)


@pytest.mark.parametrize("wrapper", sorted(_error_text.TF_WRAPPERS))
def test_a_tensorflow_wrapper_says_which_error_it_carries(wrapper):
    message = ("Graph execution error:\n\nDetected at node PyFunc:\n  File x\n\n"
               "sparkhvd.collective._engine.mesh.MeshError: allreduce failed: rank 1's control link failed\n"
               "\t [[{{node PyFunc}}]]")
    line = "MeshError: allreduce failed: rank 1's control link failed"
    assert read_text(wrapper, message, {"MeshError"}) == (Reading(WRAPPED, line),)
    assert read_text(wrapper, message, {"RunAborted"}) == ()  # only the types asked for
    assert read_text("RuntimeError", message, {"MeshError"}) == ()  # only inside TensorFlow's wrappers
    assert _collateral.headline(wrapper, message) == f"{line} (raised inside TensorFlow's {wrapper})"


def test_a_stopped_spark_context_is_read_from_any_type():
    message = ("An error occurred while calling o123.collectAndServe.\n: org.apache.spark.SparkException: Job 3 "
               "cancelled because SparkContext was shut down\n\tat org.apache.spark.scheduler.DAGScheduler...")
    assert read_text("Py4JJavaError", message) == (Reading(SPARK_STOPPED, "SparkContext was shut down"),)
    assert not _collateral.is_collateral("Py4JJavaError", message)


def test_one_message_can_say_several_things():
    message = "Connection reset by peer while the SparkContext was shut down"
    assert [r.says for r in read_text("RuntimeError", message)] == [PEER_GONE, SPARK_STOPPED]
    assert _error_text.says(read_text("RuntimeError", message), SPARK_STOPPED).text == "SparkContext was shut down"
    assert _error_text.says(read_text("ValueError", message), PEER_GONE) is None


@pytest.mark.parametrize("name", sorted(_collateral.COLLATERAL_TYPES))
def test_collateral_types_are_known_by_their_name_whatever_their_text(name):
    assert _collateral.is_collateral(name, "any text at all")


def test_the_examples_in_the_docstring_hold():
    assert doctest.testmod(_error_text).failed == 0
