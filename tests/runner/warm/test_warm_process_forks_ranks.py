"""The warm process, the zygote (runner/_warm/): ranks forked from a process that has torch imported."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import sparkhvd._common.settings
import sparkhvd.collective
from sparkhvd import HorovodRunner
from sparkhvd._common import settings
from sparkhvd.runner._agent.process import kill_group
from sparkhvd.runner._shared.package import PACKAGE_DIR
from sparkhvd.runner._warm import client as _warm_client
from sparkhvd.runner._warm import key as _warm_key
from sparkhvd.runner._warm import protocol as _warm_protocol
from sparkhvd.runner._warm import server as _warm_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux only")

WAIT_S = 60.0  # how long a test waits for a zygote to come up or go away (not a timed assertion)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _ping(key: str) -> dict | None:
    try:
        sock = _warm_client.connect(key, timeout=5.0)
    except OSError:
        return None
    try:
        return _warm_client.request(sock, {"ping": True})
    except (OSError, ValueError):
        return None
    finally:
        sock.close()


def _wait_ready(key: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        reply = _ping(key)
        if reply is not None:
            return reply
        time.sleep(0.2)
    raise AssertionError(f"no zygote answered for key {key} within {WAIT_S:.0f} s")


@pytest.fixture
def zygote(monkeypatch):
    """A zygote of this test's own (a key no agent computes), stopped at the end."""
    key = "test-" + uuid.uuid4().hex[:12]

    def start(idle_s: float | None = None) -> dict:
        env = dict(os.environ)
        if idle_s is not None:
            env[settings.WARM_IDLE_S.name] = str(idle_s)
        _warm_client.start_server(key, env)
        return _wait_ready(key)

    start.key = key
    yield start
    _warm_client.stop(key)


def _parent_and_env():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return {"ppid": os.getppid(), "pid": os.getpid(), "rank": hvd.rank(), "size": hvd.size(),
            "placement": json.loads(os.environ["SPARKHVD_PLACEMENT"])["rank"],
            "var": os.environ.get("SPARKHVD_TEST_ZYGOTE_VAR"), "warm": os.environ.get("SPARKHVD_WARM"),
            "torch_preloaded": "torch" in sys.modules, "dynamo_preloaded": "torch._dynamo" in sys.modules,
            "tensorflow": "tensorflow" in sys.modules}


def test_second_run_forks_ranks_from_the_zygote_with_their_own_env(monkeypatch):
    monkeypatch.setenv("SPARKHVD_TEST_ZYGOTE_VAR", "first")
    monkeypatch.delenv("SPARKHVD_WARM", raising=False)
    first = HorovodRunner(np=-2).run_all(_parent_and_env).values  # starts this key's zygote, if none serves
    assert [v["rank"] for v in first] == [0, 1]
    _wait_ready(_warm_key.zygote_key())
    monkeypatch.setenv("SPARKHVD_TEST_ZYGOTE_VAR", "second")
    values = HorovodRunner(np=-2).run_all(_parent_and_env).values
    assert [(v["rank"], v["size"], v["placement"]) for v in values] == [(0, 2, 0), (1, 2, 1)]
    assert [v["var"] for v in values] == ["second", "second"]  # the agent's env, not the zygote's
    assert [v["warm"] for v in values] == ["forked", "forked"]
    # what a rank's first torch.optim optimizer imports is there already (about a second of CPU per rank)
    assert all(v["torch_preloaded"] and v["dynamo_preloaded"] for v in values), values
    assert len({v["pid"] for v in values}) == 2
    for v in values:
        assert v["ppid"] != os.getpid()
        assert _warm_protocol.SERVER_MODULE in _cmdline(v["ppid"])
        assert not v["tensorflow"]  # a torch function's ranks: from the zygote that never imports TensorFlow


def _tensorflow_parent():
    preloaded = "tensorflow" in sys.modules  # before this function's import
    import tensorflow as tf

    return {"ppid": os.getppid(), "preloaded": preloaded, "sum": float(tf.reduce_sum(tf.ones(3)))}


def test_a_tensorflow_functions_ranks_fork_from_a_warm_process_that_imported_tensorflow(monkeypatch):
    """Told from the function's code (runner/_payload/frameworks.py): about 10 CPU-seconds less per rank and
    restart; TensorFlow's start-up notices still reach each rank's log."""
    pytest.importorskip("tensorflow")
    monkeypatch.delenv("SPARKHVD_WARM", raising=False)
    HorovodRunner(np=-2).run_all(_tensorflow_parent)  # starts this key's zygote, if none serves
    _wait_ready(_warm_key.zygote_key(preload=("tensorflow",)))
    result = HorovodRunner(np=-2).run_all(_tensorflow_parent)
    for rank, v in enumerate(result.values):
        assert v["preloaded"] and v["sum"] == 3.0, v
        assert _cmdline(v["ppid"]).split()[-2:] == [_warm_key.zygote_key(preload=("tensorflow",)), "tensorflow"]
        with open(result.log_paths[rank]) as f:
            assert "All log messages before absl::InitializeLog() is called" in f.read()


WARM_REPORT = """
import json, os
rank = json.loads(os.environ["SPARKHVD_PLACEMENT"])["rank"]
print("WARM", rank, os.environ.get("SPARKHVD_WARM"), os.getppid(), flush=True)
"""


def _cli_run(tmp_path, env) -> dict:
    """``python -m sparkhvd run --np 2 --master local[2]``: one Spark application; rank -> (warm, ppid)."""
    out = subprocess.run([sys.executable, "-m", "sparkhvd", "run", "--np", "2", "--master", "local[2]", "--conf",
                          "spark.ui.enabled=false", "report.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)  # a Spark application's start: 20 s alone, over 120 s under load
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split()[1:] for line in out.stdout.splitlines() if " WARM " in line]  # "[0] WARM 0 forked 123"
    return {int(rank): (warm, int(ppid)) for _, rank, warm, ppid in rows}


@pytest.mark.timeout(600)
def test_consecutive_spark_applications_fork_from_one_zygote(tmp_path):
    apps = [tmp_path / "app-1", tmp_path / "app-2"]  # each application in a working directory of its own, as
    for app in apps:  # Spark standalone gives each application's executors
        app.mkdir()
        (app / "report.py").write_text(WARM_REPORT)
    (tmp_path / "tmp").mkdir()
    mark = uuid.uuid4().hex  # in the zygote's environment: how this test finds it (it runs detached)
    env = {k: v for k, v in os.environ.items() if k != "SPARKHVD_WARM"}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARKHVD_TEST_ZYGOTE_MARK=mark,
               TMPDIR=str(tmp_path / "tmp"))  # a temp folder of its own: a key no other test's zygote has
    mark = f"SPARKHVD_TEST_ZYGOTE_MARK={mark}"
    try:
        first = _cli_run(apps[0], env)  # no zygote for this key: fresh ranks, one started
        assert sorted(first) == [0, 1] and all(warm != "forked" for warm, _ in first.values()), first
        keys = {_cmdline(pid).split()[-1] for pid in _warm_client.marked(mark)}  # python -m <SERVER_MODULE> KEY
        assert len(keys) == 1, keys
        zygote = _wait_ready(keys.pop())["pid"]
        second = _cli_run(apps[1], env)  # another application: another PYTHON_WORKER_FACTORY_SECRET and directory
        assert second == {0: ("forked", zygote), 1: ("forked", zygote)}
        assert _warm_client.marked(mark) == [zygote]  # and no second zygote
    finally:
        for pid in _warm_client.marked(mark):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.unit
def test_a_working_directory_that_would_change_what_a_rank_imports_is_refused(tmp_path):
    start, other = tmp_path / "start", tmp_path / "other"
    (start / "mine").mkdir(parents=True)
    other.mkdir()
    (start / "mine" / "__init__.py").write_text("")
    import types

    loaded = {"json": json, "mine": types.SimpleNamespace(__file__=str(start / "mine" / "__init__.py"))}
    assert _warm_key.cwd_refusal(str(start), str(start), loaded) is None  # where it started: nothing differs
    assert _warm_key.cwd_refusal(str(other), str(start), loaded) == (
        f"its module mine was imported from its working directory {start}, which the rank's is not")
    del loaded["mine"]
    assert _warm_key.cwd_refusal(str(other), str(start), loaded) is None
    (other / "__main__.py").write_text("")  # every process has a __main__; python -m never imports this one
    assert _warm_key.cwd_refusal(str(other), str(start), {**loaded, "__main__": sys.modules["__main__"]}) is None
    (other / "json.py").write_text("")  # a fresh process there would import this json
    assert _warm_key.cwd_refusal(str(other), str(start), loaded) == (
        f"the rank's working directory {other} holds a module json, which a fresh process would import instead of "
        "the preloaded one")
    assert _warm_key.cwd_refusal(str(tmp_path / "gone"), str(start), loaded).startswith(
        f"the rank's working directory {tmp_path / 'gone'} cannot be listed")


def test_warm_off_uses_fresh_processes(monkeypatch):
    monkeypatch.setenv("SPARKHVD_WARM", "0")
    values = HorovodRunner(np=-2).run_all(_parent_and_env).values
    assert [v["ppid"] for v in values] == [os.getpid(), os.getpid()]  # Popen'd by the agent threads here
    assert [v["warm"] for v in values] == ["0", "0"]


def test_a_forked_process_gets_its_env_cwd_stdio_and_exit_code(zygote, tmp_path):
    zygote()
    code = ("import os, sys, torch; print(os.environ['ZYG_VAR'], os.getcwd(), torch.get_num_threads(), "
            "sys.stdin.read()); print('to stderr', file=sys.stderr); sys.exit(3)")
    env = {"PATH": os.environ.get("PATH", ""), "ZYG_VAR": "mine", "OMP_NUM_THREADS": "1"}
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        proc = _warm_client.spawn(env, key=zygote.key, argv=["-c", code])
    finally:
        os.chdir(here)
    proc.stdin.write(b"from stdin")
    proc.stdin.close()
    out, err = proc.stdout.read(), proc.stderr.read()
    assert proc.wait() == 3
    assert proc.poll() == 3
    assert out.decode() == f"mine {tmp_path} 1 from stdin\n"
    assert err.decode() == "to stderr\n"


def test_killing_the_agent_kills_its_rank(zygote, tmp_path):
    zygote()
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        from sparkhvd.runner._warm import client as _warm_client
        proc = _warm_client.spawn(dict(os.environ), key=sys.argv[1], argv=["-c", "import time; time.sleep(600)"])
        print(proc.pid, flush=True)
        proc.wait()
    """))
    agent = subprocess.Popen([sys.executable, str(script), zygote.key], stdout=subprocess.PIPE, text=True)
    try:
        rank = int(agent.stdout.readline())
        assert _alive(rank)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + WAIT_S
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank), f"rank process {rank} outlived its killed agent by {WAIT_S:.0f} s"
    finally:
        agent.kill()
        agent.wait()
        agent.stdout.close()


def test_same_uid_connects_and_bad_requests_are_refused(zygote):
    reply = zygote()
    assert reply["key"] == zygote.key and _alive(reply["pid"])
    assert _warm_protocol.SERVER_MODULE in _cmdline(reply["pid"])
    for raw in (b"{not json", b"[1, 2]", json.dumps({"env": {}, "cwd": "/", "argv": ["-c", "pass"]}).encode(),
                json.dumps({"env": {"A": 1}, "cwd": "/", "argv": ["-c", "pass"]}).encode(),
                json.dumps({"env": {}, "cwd": "/", "argv": ["python", "x.py"]}).encode()):
        sock = _warm_client.connect(zygote.key)
        try:
            sock.sendall(raw)
            answer = json.loads(sock.recv(65536))
        finally:
            sock.close()
        assert answer["error"].startswith("bad request: "), (raw, answer)
    assert _ping(zygote.key)["pid"] == reply["pid"]  # still serving


def test_zygote_exits_after_its_idle_time(zygote):
    pid = zygote(idle_s=1)["pid"]
    deadline = time.monotonic() + WAIT_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), f"the zygote {pid} with {settings.WARM_IDLE_S.name}=1 was still running after {WAIT_S:.0f} s"
    assert _ping(zygote.key) is None


@pytest.mark.unit
def test_key_hashes_the_whole_sparkhvd_package():
    assert os.path.isfile(os.path.join(PACKAGE_DIR, "__init__.py"))
    files = set(_warm_key._package_files(PACKAGE_DIR))
    for module in (_warm_key, _warm_protocol, sparkhvd.collective, sparkhvd._common.settings):
        assert os.path.abspath(module.__file__) in files, module.__name__


@pytest.mark.unit
def test_key_changes_when_sparkhvd_or_the_environment_changes(tmp_path):
    package = tmp_path / "sparkhvd"
    shutil.copytree(os.path.dirname(os.path.dirname(_warm_key.__file__)), package / "runner")
    (package / "__init__.py").write_text("")
    (package / "tests").mkdir()
    (package / "tests" / "__init__.py").write_text("")
    private = package / "collective" / "_core"  # a private sub-package is as much the package as a public one
    private.mkdir(parents=True)
    for folder in (package / "collective", private):
        (folder / "__init__.py").write_text("")
    (private / "_ops.py").write_text("A = 1\n")
    torch_files = [str(tmp_path / "torch_version.py")]
    (tmp_path / "torch_version.py").write_text("__version__ = '1'\n")
    env = {"PYTHONPATH": "/a"}

    def key(**changes):
        return _warm_key.zygote_key(str(package), torch_files, {**env, **changes})

    before = key()
    assert key() == before
    assert key(SOME_OTHER_VAR="x", OMP_NUM_THREADS="3") == before  # applied by the fork, not a new zygote
    assert key(PYTHONPATH="/b") != before
    assert key(TMPDIR="/sandbox-of-another-job") != before  # its ranks fork from a zygote of their own
    assert key(PYTHONHASHSEED="0") != before  # a forked rank hashes strings with the zygote's seed
    assert key(PYTHON_GIL="0") != before  # CPython's own PYTHON_ names count too
    for name in ("TORCH_LOGS", "TORCHDYNAMO_VERBOSE", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF"):
        assert key(**{name: "x"}) != before, name  # read when torch and the torch._dynamo it preloads load
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "KERAS_BACKEND"):
        assert key(**{name: "1"}) != before, name  # read when the TensorFlow zygote's imports load
    assert key(TF_CONFIG='{"task": {"type": "worker", "index": 0}}') == before  # read by a strategy, per rank
    assert _warm_key.zygote_key(str(package), torch_files, env, preload=("tensorflow",)) != before  # its own zygote
    spark_per_application = {  # what one Spark application's Python workers see and the next one's do not
        "PYTHON_WORKER_FACTORY_SECRET": "1436191ff3fbe5ff", "PYTHON_WORKER_FACTORY_PORT": "40123",
        "PYTHON_WORKER_FACTORY_SOCK_DIR": "/tmp/spark-1/sock", "PYTHON_FAULTHANDLER_DIR": "/tmp/spark-1/fault",
        "PYTHON_UDF_BATCH_SIZE": "100", "PYTHON_DAEMON_KILL_WORKER_ON_FLUSH_FAILURE": "1",
        "SPARK_LOCAL_DIRS": "/tmp/blockmgr-1", "SPARK_EXECUTOR_DIRS": "/tmp/spark-1/executor-1",
        "SPARK_LOG_URL_STDERR": "http://h:8081/logPage/?appId=app-1", "_PYSPARK_DRIVER_CONN_INFO_PATH": "/tmp/c"}
    assert key(**spark_per_application) == before
    assert key(**{**spark_per_application, "PYTHON_WORKER_FACTORY_SECRET": "260616f2e31e09db"}) == before
    (package / "tests" / "__init__.py").write_text("# tests are not part of the package\n")
    assert key() == before
    worker = package / "runner" / "_rank" / "worker.py"
    worker.write_text(worker.read_text() + "\n# edited\n")
    edited = key()
    assert edited != before
    (private / "_ops.py").write_text("A = 2\n")
    assert key() != edited
    edited = key()
    (tmp_path / "torch_version.py").write_text("__version__ = '2'\n")
    assert key() != edited
    assert _warm_protocol.address(before) == "\0sparkhvd-zygote-" + before  # abstract: no file in the temp dir


def test_killing_a_forked_rank_group_reports_minus_nine(zygote):
    zygote()
    proc = _warm_client.spawn({"PATH": os.environ.get("PATH", "")}, key=zygote.key,
                         argv=["-c", "import time; time.sleep(600)"])
    # The pid comes back only once the rank leads its own session and group: killing the group at once reaches it
    # (without that, a killed agent could leave its rank running; without the zygote's wait, 94 in 100 spawns failed).
    assert (os.getsid(proc.pid), os.getpgid(proc.pid)) == (proc.pid, proc.pid)
    proc.stdin.close()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    assert proc.poll() is None
    assert _warm_protocol.SERVER_MODULE not in _cmdline(proc.pid)  # ps shows the rank as `python -c`
    kill_group(proc)  # what the agent and LocalLauncher.stop do
    assert proc.wait() == -9
    proc.stdout.close()
    proc.stderr.close()


@pytest.mark.unit
@pytest.mark.parametrize("data, flags, error", [
    (b"", 0, "empty request"),
    (b"{}", socket.MSG_TRUNC, f"the request is over {_warm_protocol.MAX_REQUEST_BYTES} bytes"),
    (b"[1, 2]", 0, "the request is not a JSON object"),
])
def test_a_request_that_is_not_one_json_object_is_refused_saying_why(data, flags, error):
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        _warm_server._message(data, flags)


@pytest.mark.unit
@pytest.mark.parametrize("change, fds, error", [
    ({"env": {"A": 1}}, 3, "'env' must be an object of strings"),
    ({"cwd": None}, 3, "'cwd' must be a string"),
    ({"argv": ["python", "x.py"]}, 3, "'argv' must be [\"-m\", module, ...] or [\"-c\", code, ...]"),
    ({"argv": ["-m"]}, 3, "'argv' must be [\"-m\", module, ...] or [\"-c\", code, ...]"),
    ({}, 0, "the request must carry 3 file descriptors (stdin, stdout, stderr), not 0"),
])
def test_a_rank_request_with_a_bad_field_is_refused_naming_it(tmp_path, change, fds, error):
    message = {"env": {"A": "1"}, "cwd": str(tmp_path), "argv": ["-m", "mine"], **change}
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        _warm_server._rank_request(message, list(range(fds)), str(tmp_path))


@pytest.mark.unit
def test_a_rank_request_is_its_env_cwd_and_argv(tmp_path):
    message = {"env": {"A": "1"}, "cwd": str(tmp_path), "argv": ["-c", "pass", "x"], "extra": 1}
    assert _warm_server._rank_request(message, [4, 5, 6], str(tmp_path)) == (
        {"A": "1"}, str(tmp_path), ["-c", "pass", "x"])


@pytest.mark.unit
def test_a_rank_request_from_a_directory_that_shadows_a_preloaded_module_is_refused(tmp_path):
    start, other = tmp_path / "start", tmp_path / "other"
    start.mkdir()
    other.mkdir()
    (other / "json.py").write_text("")  # json is loaded in this process: a fresh rank there would import this one
    message = {"env": {}, "cwd": str(other), "argv": ["-c", "pass"]}
    with pytest.raises(ValueError, match="^" + re.escape(f"the rank's working directory {other} holds a module json")):
        _warm_server._rank_request(message, [0, 1, 2], str(start))


@pytest.mark.unit
def test_a_bad_idle_time_names_the_setting_and_the_fix():
    assert settings.WARM_IDLE_S.get({}) == 600.0
    assert settings.WARM_IDLE_S.get({"SPARKHVD_WARM_IDLE_S": "1"}) == 1.0
    with pytest.raises(ValueError, match=re.escape(
            "SPARKHVD_WARM_IDLE_S='soon' is not a number of seconds; set it to how long a warm process with no rank "
            "running stays, such as 600.")):
        settings.WARM_IDLE_S.get({"SPARKHVD_WARM_IDLE_S": "soon"})
