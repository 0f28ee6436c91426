"""RunnerConfig's keyword-only fields, which the drop-ins and estimators set: checked on creation, never written
after (HorovodRunner._from_config runs a config as it was made)."""

from __future__ import annotations

import dataclasses

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.runner._runner_config import RunnerConfig

pytestmark = pytest.mark.unit


def test_the_drop_in_fields_are_keyword_only_with_the_runners_defaults():
    config = RunnerConfig(2)
    assert (config.layout, config.use_gpu, config.warn_unencrypted, config.one_rank_per_task, config.stall_tasks) == (
        "torchrun", True, True, False, frozenset())
    assert {f.name for f in dataclasses.fields(RunnerConfig) if f.kw_only} == {
        "layout", "use_gpu", "warn_unencrypted", "one_rank_per_task", "dataframe", "stall_tasks"}
    assert HorovodRunner(np=2).config == config


@pytest.mark.parametrize("name", ["use_gpu", "warn_unencrypted", "one_rank_per_task"])
def test_a_flag_that_is_not_a_bool_is_refused(name):
    with pytest.raises(ValueError, match=rf"^{name}='no' must be True or False\.$"):
        RunnerConfig(2, **{name: "no"})


@pytest.mark.parametrize("tasks", [{0}, frozenset({2}), frozenset({-1}), frozenset({True})])
def test_stall_tasks_outside_the_runs_tasks_are_refused(tasks):
    with pytest.raises(ValueError, match=r"^stall_tasks=.* must be a frozenset of task indices from 0 to 1 \(np=-2\): "
                                         r"the tasks whose agents never register\.$"):
        RunnerConfig(-2, stall_tasks=tasks)


def test_a_runner_from_a_config_runs_that_config():
    config = RunnerConfig(3, layout="node_per_task", use_gpu=False, warn_unencrypted=False, stall_tasks=frozenset({1}))
    runner = HorovodRunner._from_config(config)
    assert runner.config is config and runner.np == 3 and runner.last_result is None
