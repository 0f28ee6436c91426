"""Script mode (HorovodRunner(np).run("train.py", *args)) and the MLflow hand-over, with real rank processes."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.runner import HorovodRunError
from sparkhvd.runner._payload.script import as_payload

# Each rank writes what it saw to <out>/rank-<r>.json; a sibling module proves the script's folder ships.
REPORT = textwrap.dedent("""
    import json, os, sys
    import helper
    rank = int(json.loads(os.environ["SPARKHVD_PLACEMENT"])["rank"])
    out = sys.argv[sys.argv.index("--out") + 1]
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
                   "helper": helper.VALUE}, f)
""")


def _script(folder, body, name="train.py"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "helper.py").write_text("VALUE = 42\n")
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def _reports(out, n):
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]


def test_script_runs_as_main_with_its_argv_on_every_rank(tmp_path, monkeypatch):
    path = _script(tmp_path / "job", REPORT + "sys.exit(0)  # success, as for python\n")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    runner = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only")
    assert runner.run("job/train.py", "--epochs", 3, "--out", out) is None
    assert runner.last_result.values == [None, None]
    for report in _reports(out, 2):
        path0 = report.pop("path0")  # the shipped copy of the script's folder (tests/runner/payload/test_script_folder.py)
        assert os.path.basename(path0).startswith("sparkhvd-script-") and not os.path.exists(path0)
        assert report == {"argv": ["job/train.py", "--epochs", "3", "--out", str(out)], "name": "__main__",
                          "file": str(path), "helper": 42}


def test_run_all_runs_a_script_and_every_value_is_none(tmp_path):
    path = _script(tmp_path, REPORT)
    out = tmp_path / "out"
    out.mkdir()
    result = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(str(path), "--out", str(out))
    assert result.values == [None, None]
    assert [r["argv"][1:] for r in _reports(out, 2)] == [["--out", str(out)]] * 2


def test_the_source_travels_with_the_payload_and_tracebacks_show_its_lines(tmp_path):
    """The ranks never read the file: it is gone before they start, yet they run it and quote its lines."""
    path = _script(tmp_path, """
        import sys
        print("running", sys.argv[1:])
        raise ValueError("bad epoch " + sys.argv[1])
    """)
    fn, kwargs = as_payload(str(path), ("7",), {})
    os.remove(path)
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run(fn, **kwargs)
    text = str(info.value)
    assert "rank 0: ValueError: bad epoch 7" in text
    assert 'raise ValueError("bad epoch " + sys.argv[1])' in text  # the line, from the shipped source
    assert not info.value.retryable


def test_sys_exit_with_a_status_fails_the_run_naming_it_and_is_not_retried(tmp_path):
    path = _script(tmp_path, "import sys\nsys.exit(3)\n")
    with pytest.raises(HorovodRunError, match=rf"ScriptExit: the script {path} exited with status 3 "
                                              r"\(sys.exit\(3\)\)") as info:
        HorovodRunner(np=-2, max_restarts=1, driver_log_verbosity="log_callback_only").run(str(path))
    assert len(info.value.attempts) == 1 and not info.value.retryable


def test_sys_exit_with_a_message_is_status_1_and_quotes_it(tmp_path):
    path = _script(tmp_path, "import sys\nsys.exit('no data in /mnt/x')\n")
    with pytest.raises(HorovodRunError, match=r"exited with status 1 \(sys.exit\('no data in /mnt/x'\)\): "
                                              r"no data in /mnt/x"):
        HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run(str(path))


# --- errors on the driver, before anything launches -------------------------------------------------------------

def test_missing_script_is_a_sentence_with_the_path_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"^the script 'nope.py' does not exist \(looked in {tmp_path}\); pass the "
                                         "path of a Python file on the driver"):
        HorovodRunner(np=-1).run("nope.py")


def test_folder_is_not_a_script(tmp_path):
    with pytest.raises(ValueError, match=rf"^the script '{tmp_path}' is not a file; pass the path of a Python file "
                                         rf"\(e.g. '{tmp_path}/train.py'\), not a folder."):
        HorovodRunner(np=-1).run(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc/self/mem, a file no read succeeds on")
def test_unreadable_script(tmp_path):
    with pytest.raises(ValueError, match=r"^the script '/proc/self/mem' cannot be read on the driver \(Input/output "
                                         r"error\); make it readable"):
        HorovodRunner(np=-1).run("/proc/self/mem")


def test_script_with_a_syntax_error_fails_on_the_driver(tmp_path):
    path = _script(tmp_path, "import sys\ndef f(:\n    pass\n")
    with pytest.raises(ValueError, match=rf"^the script '{path}' is not valid Python source \(line 2: .*\); fix it, "
                                         "or check that the path names your training script."):
        HorovodRunner(np=-1).run(str(path))


def test_binary_file_is_not_python_source(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x80\x02\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=rf"^the script '{path}' is not valid Python source"):
        HorovodRunner(np=-1).run(str(path))


def test_positional_arguments_with_a_function_are_a_type_error():
    def train(lr):
        return lr

    with pytest.raises(TypeError, match=r"^HorovodRunner.run got 1 positional argument after the function 'train'; "
                                        r"pass the function's arguments by keyword \(run\(train, lr=0.1\)\)"):
        HorovodRunner(np=-1).run(train, 0.1)


def test_keyword_arguments_with_a_script_are_a_type_error(tmp_path):
    path = _script(tmp_path, "pass\n")
    with pytest.raises(TypeError, match=r"^HorovodRunner.run got keyword arguments \(epochs, lr\) for the script .*, "
                                        "which takes command-line arguments only; pass them as strings"):
        HorovodRunner(np=-1).run(str(path), lr=0.1, epochs=3)


def test_script_arguments_must_be_strings(tmp_path):
    path = _script(tmp_path, "pass\n")
    with pytest.raises(TypeError, match=r"command-line arguments of the script .* must be strings \(or numbers or "
                                        r"paths, turned into strings\), got \['a'\] \(list\)"):
        HorovodRunner(np=-1).run(str(path), ["a"])


# --- MLflow: the ranks log into the driver's active run -----------------------------------------------------------

def _log_on_rank_0():
    import mlflow

    from sparkhvd._common import context as _context

    given = os.environ.get("MLFLOW_RUN_ID")  # read first: mlflow takes it out of the environment when it resumes
    if _context.current().placement.rank == 0:
        mlflow.log_metric("loss", 0.25, step=1)
        mlflow.log_param("rank_env_run", given)
    return given


def _check_ranks_log_into_the_driver_run(tmp_path, monkeypatch, np, **runner_kw):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'sparkhvd[mlflow]'")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    mlflow.set_tracking_uri(f"file://{tmp_path}/mlruns")
    try:
        with mlflow.start_run() as run:
            values = HorovodRunner(np=np, driver_log_verbosity="log_callback_only", **runner_kw).run_all(
                _log_on_rank_0).values
            client = mlflow.MlflowClient()
            seen = client.get_run(run.info.run_id)
            assert seen.info.status == "RUNNING"  # a rank's exit did not end the driver's run
        assert values == [run.info.run_id] * abs(np)
        assert {k: v for k, v in seen.data.metrics.items() if "/rank_" not in k} == {"loss": 0.25}  # besides the
        # ranks' own metrics, which sparkhvd logs (tests/runner/payload/test_mlflow_metrics.py)
        assert seen.data.params == {"rank_env_run": run.info.run_id}
        assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
        assert client.get_run(run.info.run_id).info.status == "FINISHED"
    finally:
        mlflow.set_tracking_uri(None)


def test_ranks_log_into_the_drivers_active_mlflow_run(tmp_path, monkeypatch):
    _check_ranks_log_into_the_driver_run(tmp_path, monkeypatch, np=-2)


@pytest.mark.slow
def test_spark_ranks_log_into_the_drivers_active_mlflow_run(tmp_path, monkeypatch, spark):
    _check_ranks_log_into_the_driver_run(tmp_path, monkeypatch, np=2)


def test_without_an_active_mlflow_run_ranks_get_no_run_id(monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    values = HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run_all(
        lambda: os.environ.get("MLFLOW_RUN_ID")).values
    assert values == [None]
