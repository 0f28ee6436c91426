"""A script run ships the script's folder: its modules, packages and config files reach every rank, nothing else does,
and the unpacked copy is gone after the run. Real rank processes (np<0), one CLI run, one Spark run (slow)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import zipfile

import pytest

from sparkhvd import HorovodRunner
from sparkhvd._common.settings import SCRIPT_FOLDER_MAX_BYTES, SCRIPT_FOLDER_MAX_FILES, SHIP_SCRIPT_FOLDER
from sparkhvd.runner import HorovodRunError
from sparkhvd.runner._cli import main as cli_main
from sparkhvd.runner._payload.script import as_payload
from sparkhvd.runner._payload.script_folder import FolderLimits, collect, unpack

WAYS_OUT = ("move the script into a folder of its own with the modules it imports, install your code as a package "
            "on every host, or ship it with --py-files or sc.addPyFile and set SPARKHVD_SHIP_SCRIPT_FOLDER=0 to ship "
            "the script alone")

# Each rank writes what it saw to <out>/rank-<r>.json, then, with --fail, rank 1 raises inside model.py once rank 0
# has written its report, and rank 0 waits to be stopped by the driver.
TRAIN = """
    import json, os, sys, time
    import model, mypkg.sub, helpers.tools
    rank = int(json.loads(os.environ["SPARKHVD_PLACEMENT"])["rank"])
    out = sys.argv[sys.argv.index("--out") + 1]
    root = sys.path[0]
    shipped = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"root": root, "mode": os.stat(root).st_mode & 0o777, "file": __file__, "model": model.__file__,
                   "sub": mypkg.sub.__file__, "tools": helpers.tools.__file__, "settings": mypkg.SETTINGS,
                   "shipped": [p for p in shipped if "__pycache__" not in p]}, f)
    if "--fail" in sys.argv:
        if rank == 1:
            while not os.path.exists(os.path.join(out, "rank-0.json")):
                time.sleep(0.01)
            model.fail(7)
        time.sleep(600)  # stopped by the driver when rank 1 fails
"""

SHIPPED = ["helpers/tools.py", "model.py", "mypkg/__init__.py", "mypkg/settings.json", "mypkg/sub.py", "notes.txt",
           "train.py"]


def _write(root, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A script's folder with modules and a package that ship, and data, .git, a venv and more that do not."""
    base = tmp_path_factory.mktemp("script-folder")
    root = base / "proj"
    _write(root, {
        "train.py": TRAIN,
        "model.py": "def fail(batch):\n    raise ValueError(f'bad batch {batch}')\n",
        "mypkg/__init__.py": "import json, os\n"
                             "SETTINGS = json.load(open(os.path.join(os.path.dirname(__file__), 'settings.json')))\n",
        "mypkg/settings.json": '{"lr": 0.5}',
        "mypkg/sub.py": "VALUE = 1\n",
        "mypkg/weights.npy": "data, even inside a package",
        "helpers/tools.py": "VALUE = 2\n",  # a namespace package
        "notes.txt": "a config-like file beside the script ships",
        "data.csv": "a,b\n1,2\n",
        "table.parquet": "PAR1",
        "runs/meta.yaml": "config-like, but outside the folder and its packages: stays",
        "raw-data/loader.py": "# a folder no import can name",
        ".git/config": "[core]\n",
        ".git/hook.py": "",
        ".env": "TOKEN=secret\n",
        "venv/pyvenv.cfg": "home = /usr/bin\n",
        "venv/lib/site.py": "",
        "env/lib/other.py": "",
        "site-packages/dep.py": "",
        "node_modules/x/index.py": "",
        "__pycache__/model.cpython-311.py": "",
    })
    (root / "env" / "bin").mkdir()
    (root / "env" / "bin" / "python").symlink_to(sys.executable)  # a virtual environment without pyvenv.cfg
    _write(base, {"elsewhere/outside.py": "", "elsewhere/lib/inside.py": ""})
    (root / "outside.py").symlink_to(base / "elsewhere" / "outside.py")  # symlinks that leave the folder
    (root / "linked").symlink_to(base / "elsewhere" / "lib")
    (root / "loop").symlink_to(root)  # and one back into it, not followed twice
    return root


def _names(shipped) -> list:
    return sorted(zipfile.ZipFile(io.BytesIO(shipped.zip)).namelist())


def test_only_modules_packages_and_their_config_files_ship(project):
    shipped = collect(str(project), FolderLimits())
    assert _names(shipped) == SHIPPED
    assert (shipped.files, shipped.driver_folder) == (len(SHIPPED), str(project))
    assert shipped.size == sum((project / name).stat().st_size for name in SHIPPED)


@pytest.fixture(scope="module")
def ran(project, tmp_path_factory):
    """One np=-2 run of the project's script, the ranks' TMPDIR a folder of its own."""
    out = tmp_path_factory.mktemp("out")
    rank_tmp = tmp_path_factory.mktemp("rank-tmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(rank_tmp))
        mp.setenv("SPARKHVD_WARM", "0")  # no warm process of this temp folder's own (the key holds TMPDIR)
        HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run(str(project / "train.py"),
                                                                           "--out", str(out))
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)], rank_tmp


def test_ranks_import_the_shipped_copies_from_a_private_folder(project, ran):
    reports, rank_tmp = ran
    assert reports[0]["root"] != reports[1]["root"]
    for report in reports:
        root = report["root"]  # sys.path[0]
        assert os.path.dirname(root) == str(rank_tmp) and os.path.basename(root).startswith("sparkhvd-script-")
        assert report["mode"] == 0o700
        assert report["model"] == os.path.join(root, "model.py")
        assert report["sub"] == os.path.join(root, "mypkg", "sub.py")
        assert report["tools"] == os.path.join(root, "helpers", "tools.py")
        assert report["settings"] == {"lr": 0.5}  # read beside the package's shipped __init__.py
        assert report["file"] == str(project / "train.py")  # the script's own path, as before
        assert report["shipped"] == SHIPPED


def test_the_unpacked_folders_are_gone_after_the_run(ran):
    reports, rank_tmp = ran
    assert not any(os.path.exists(r["root"]) for r in reports)
    assert os.listdir(rank_tmp) == []


def test_a_stopped_rank_removes_its_folder_and_tracebacks_name_the_drivers_files(project, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("SPARKHVD_WARM", "0")  # no warm process of this temp folder's own (the key holds TMPDIR)
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run(str(project / "train.py"),
                                                                           "--out", str(out), "--fail")
    text = str(info.value)
    assert "rank 1: ValueError: bad batch 7" in text
    assert f'File "{project / "model.py"}", line 2, in fail\n' in text  # the driver's path, not the copy's
    assert "raise ValueError(f'bad batch {batch}')" in text  # its line, though the copy is gone
    stopped = json.loads((out / "rank-0.json").read_text())["root"]  # rank 0 was stopped by the driver
    assert not os.path.exists(stopped)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_the_ranks_need_not_see_the_drivers_folder(tmp_path):
    """As on executors without the driver's filesystem: the folder is gone before the ranks start."""
    _write(tmp_path / "job", {"train.py": "import model\nmodel.check()\n",
                              "model.py": "def check():\n    raise ValueError(f'ran from {__file__}')\n"})
    fn, kwargs = as_payload(str(tmp_path / "job" / "train.py"), (), {})
    (tmp_path / "job").rename(tmp_path / "moved")
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run(fn, **kwargs)
    text = str(info.value)
    assert f"ValueError: ran from {os.path.realpath(tempfile.gettempdir())}/sparkhvd-script-" in text
    assert f'File "{tmp_path / "job" / "model.py"}", line 2, in check\n    raise ValueError(' in text


def test_shipping_turned_off_imports_from_the_scripts_folder(project, tmp_path, monkeypatch):
    monkeypatch.setenv(SHIP_SCRIPT_FOLDER.name, "0")
    HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run(str(project / "train.py"), "--out",
                                                                       str(tmp_path))
    report = json.loads((tmp_path / "rank-0.json").read_text())
    assert (report["root"], report["model"]) == (str(project), str(project / "model.py"))


def test_the_cli_ships_the_folder(project, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), SPARKHVD_WARM="0")  # no warm process of this temp folder's own
    proc = subprocess.run([sys.executable, "-m", "sparkhvd", "run", "--np", "-2", "train.py", "--out", str(tmp_path)],
                          cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert report["model"] == os.path.join(report["root"], "model.py") and report["shipped"] == SHIPPED
    assert [p for p in os.listdir(tmp_path) if p.startswith("sparkhvd-script-")] == []


@pytest.mark.slow
def test_spark_ranks_import_the_shipped_copies(project, tmp_path, spark):
    HorovodRunner(np=2, driver_log_verbosity="log_callback_only").run(str(project / "train.py"), "--out",
                                                                      str(tmp_path))
    for rank in range(2):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert os.path.basename(report["root"]).startswith("sparkhvd-script-")
        assert report["model"] == os.path.join(report["root"], "model.py") and report["shipped"] == SHIPPED
        assert not os.path.exists(report["root"])


# --- refused on the driver, before anything launches --------------------------------------------------------------

def test_too_many_files_is_refused_with_the_count_the_bound_and_the_ways_out(tmp_path, monkeypatch):
    _write(tmp_path, {"train.py": "", **{f"lib/m{i}.py": "" for i in range(5)}})
    monkeypatch.setenv(SCRIPT_FOLDER_MAX_FILES.name, "2")
    with pytest.raises(ValueError) as info:
        HorovodRunner(np=-1).run(str(tmp_path / "train.py"))
    assert str(info.value) == (f"the script's folder {tmp_path} holds 6 Python and config files to ship to the ranks, "
                               f"over the bound of 2 (SPARKHVD_SCRIPT_FOLDER_MAX_FILES), 5 of them under lib/; "
                               f"{WAYS_OUT}; or raise SPARKHVD_SCRIPT_FOLDER_MAX_FILES.")


def test_too_large_is_refused_naming_the_largest_file(tmp_path, monkeypatch):
    _write(tmp_path, {"train.py": "x = 1\n", "model.py": "#" * 120})
    monkeypatch.setenv(SCRIPT_FOLDER_MAX_BYTES.name, "100")
    with pytest.raises(ValueError) as info:
        HorovodRunner(np=-1).run(str(tmp_path / "train.py"))
    assert str(info.value) == (f"the script's folder {tmp_path} holds 126 bytes of Python and config files to ship to "
                               "the ranks, over the bound of 100 bytes (SPARKHVD_SCRIPT_FOLDER_MAX_BYTES), the largest "
                               f"being model.py (120 bytes); {WAYS_OUT}; or raise SPARKHVD_SCRIPT_FOLDER_MAX_BYTES.")


def test_a_folder_too_big_to_look_through_is_refused(tmp_path, monkeypatch):
    _write(tmp_path, {"train.py": "", **{f"{i}.png": "" for i in range(210)}})
    monkeypatch.setenv(SCRIPT_FOLDER_MAX_FILES.name, "2")  # looks through 200 files and folders at most
    with pytest.raises(ValueError) as info:
        HorovodRunner(np=-1).run(str(tmp_path / "train.py"))
    assert str(info.value) == (f"the script's folder {tmp_path} holds more than 200 files and folders (the bound is "
                               "100 times SPARKHVD_SCRIPT_FOLDER_MAX_FILES), too many to look through for the modules "
                               f"to ship to the ranks; {WAYS_OUT}; or raise SPARKHVD_SCRIPT_FOLDER_MAX_FILES.")


@pytest.mark.unit
def test_folders_without_code_are_not_looked_through_and_odd_names_stay_behind(tmp_path, monkeypatch):
    _write(tmp_path, {"train.py": "", "ns/pkg/__init__.py": "", "ns/pkg/mod.py": "",  # a namespace package
                      **{f"images/{c}/{i}.png": "" for c in ("cats", "dogs") for i in range(150)}})
    for odd in ("back\\slash.json", "caf\udce9.json"):  # unpacked as they are, neither would be the same file
        with open(os.path.join(tmp_path, odd), "w"):
            pass
    monkeypatch.setenv(SCRIPT_FOLDER_MAX_FILES.name, "3")  # 300 files and folders to look through: the 302 images are not counted
    shipped = collect(str(tmp_path), FolderLimits.from_env())
    with zipfile.ZipFile(io.BytesIO(shipped.zip)) as archive:
        assert sorted(archive.namelist()) == ["ns/pkg/__init__.py", "ns/pkg/mod.py", "train.py"]


@pytest.mark.unit
def test_the_filesystem_root_is_not_a_project():
    with pytest.raises(ValueError) as info:
        collect("/", FolderLimits())
    assert str(info.value) == ("the script's folder is /, the filesystem's root, whose files are not a project to "
                               f"ship to the ranks; {WAYS_OUT}.")


@pytest.mark.unit
def test_the_cli_refuses_a_folder_above_the_bound_as_bad_usage(tmp_path, monkeypatch, capsys):
    _write(tmp_path, {"train.py": "", "model.py": ""})
    monkeypatch.setenv(SCRIPT_FOLDER_MAX_FILES.name, "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli_main(["run", "--np", "-1", "train.py"])
    assert info.value.code == 2
    assert (f"sparkhvd run: error: the script's folder {tmp_path} holds 2 Python and config files to ship to the "
            "ranks, over the bound of 1") in capsys.readouterr().err


@pytest.mark.parametrize("name, value, message", [
    (SHIP_SCRIPT_FOLDER.name, "maybe", "SPARKHVD_SHIP_SCRIPT_FOLDER='maybe' is not 1 or 0 (nor true/false, yes/no, on/off); set it "
                        "to 0 to ship the script alone (not the modules beside it), or unset it."),
    (SCRIPT_FOLDER_MAX_BYTES.name, "10MB", "SPARKHVD_SCRIPT_FOLDER_MAX_BYTES='10MB' is not a whole number of bytes above 0; set it "
                            "to e.g. 50000000, or unset it for the default 10000000."),
    (SCRIPT_FOLDER_MAX_FILES.name, "0", "SPARKHVD_SCRIPT_FOLDER_MAX_FILES='0' is not a whole number of files above 0; set it to e.g. "
                         "5000, or unset it for the default 1000."),
])
@pytest.mark.unit
def test_bad_settings_are_sentences(name, value, message):
    with pytest.raises(ValueError) as info:
        FolderLimits.from_env({name: value})
    assert str(info.value) == message


@pytest.mark.unit
def test_settings_and_their_defaults():
    assert FolderLimits.from_env({}) == FolderLimits(ship=True, max_bytes=10_000_000, max_files=1000)
    assert FolderLimits.from_env({SHIP_SCRIPT_FOLDER.name: "off", SCRIPT_FOLDER_MAX_BYTES.name: "5", SCRIPT_FOLDER_MAX_FILES.name: "7"}) == FolderLimits(
        ship=False, max_bytes=5, max_files=7)


# --- unpacking on a rank ------------------------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("member", ["../evil.py", "/tmp/evil.py", "pkg/../../evil.py", "pkg\\..\\evil.py"])
def test_unpack_refuses_a_member_that_leaves_the_folder(tmp_path, member):
    into = tmp_path / "into"
    into.mkdir()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("ok.py", "")
        archive.writestr(member, "import os  # would run from outside the folder")
    with pytest.raises(ValueError) as info:
        unpack(buffer.getvalue(), str(into))
    assert str(info.value) == (f"the shipped script folder holds a file named {member!r}, which would be written "
                               f"outside the folder it is unpacked into ({into}); only relative names without '..' "
                               "are unpacked, so this payload was not built by sparkhvd's collect.")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["into", "ok.py"]
