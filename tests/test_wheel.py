"""The package as users get it: an sdist built from a copy of this checkout, a wheel built from that
sdist, the wheel installed (not editable) into a fresh virtual environment, then imported and run on
Spark from outside the source tree. ``make test`` installs with ``-e``, which serves every file of the
checkout whatever the build would ship; this test sees what the build ships."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What builds, test runs and tools leave in a checkout. Not copied from this one (so the build sees the
# same tree on every machine); one file is planted in each, in the copy, and none may reach the sdist.
LITTER = ("__pycache__", ".pytest_cache", ".hypothesis", ".venv", "build", "dist", "logs", "spark-warehouse",
          "metastore_db", ".hvdtests", ".whl", ".gl")
NOT_THE_PACKAGE = ("tests", "bench", "notebooks", "docs")  # folders of the repository, not of the package
# The sdist's files besides the package's .py files, and what every setuptools sdist has in <name>.egg-info/.
SDIST_TOP = {"PKG-INFO", "setup.cfg", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md"}
EGG_INFO = {"PKG-INFO", "SOURCES.txt", "dependency_links.txt", "entry_points.txt", "requires.txt", "top_level.txt"}
PRIVATE_IMPORTED = ("sparkhvd.collective._core",)  # a private package the public ones stand on


def _run(args, **kw):
    out = subprocess.run(args, capture_output=True, text=True, timeout=240, **kw)
    assert out.returncode == 0, f"{args} exited with {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _package_files(root: str) -> set:
    """The package's .py files in a checkout (relative to it): every folder with an __init__.py."""
    found = set()
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in NOT_THE_PACKAGE + LITTER
                   and os.path.exists(os.path.join(folder, d, "__init__.py"))]
        found.update(os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py"))
    return found - {"setup.py"}


def _copy_with_litter(src: str) -> None:
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "*.egg-info", *LITTER))
    for folder in (*LITTER, os.path.join("runner", "__pycache__")):
        os.makedirs(os.path.join(src, folder), exist_ok=True)
        with open(os.path.join(src, folder, "left_behind.py"), "w") as f:
            f.write("LITTER = True\n")
    with open(os.path.join(src, "runner", "__pycache__", "_cli.cpython-311.pyc"), "wb") as f:
        f.write(b"\0")


def _build(src: str, dist: str, unpacked: str) -> tuple:
    """The sdist (setuptools' PEP 517 hook, as ``python -m build --sdist`` calls it), then the wheel
    from the unpacked sdist (pip, offline, with this environment's setuptools); their file lists."""
    hook = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    sdist = _run([sys.executable, "-c", hook, dist], cwd=src).stdout.split()[-1]
    with tarfile.open(os.path.join(dist, sdist)) as tar:
        sdist_names = [m.name for m in tar.getmembers() if m.isfile()]
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
          "-q", "-w", dist, os.path.join(unpacked, sdist_names[0].split("/")[0])])
    wheel = os.path.join(dist, next(n for n in os.listdir(dist) if n.endswith(".whl")))
    with zipfile.ZipFile(wheel) as whl:
        return wheel, [n.split("/", 1)[1] for n in sdist_names], whl.namelist()


def _venv_with(wheel: str, venv: str) -> str:
    """A new venv with ``wheel`` installed (not editable) and this environment's packages (torch,
    pyspark, TensorFlow) after its own site-packages, through a .pth that lists their folders: their
    .pth files never run, so the editable install's finder never loads and sparkhvd can only come
    from the wheel. Returns the venv's python."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = os.path.join(venv, "bin", "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--no-cache-dir",
          "-q", wheel])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    with open(os.path.join(site, "_sparkhvd_test_outer_env.pth"), "w") as f:
        f.write("".join(f"{path}\n" for path in ours))
    return python


@pytest.fixture(scope="module")
def built():
    """Everything in one temp folder, removed at the end: the copy, the builds, the venv, the run's cwd."""
    tmp = tempfile.mkdtemp(prefix="sparkhvd-wheel-")
    try:
        src = os.path.join(tmp, "src")
        _copy_with_litter(src)
        package = _package_files(src)  # this copy's, the build's input (the checkout may change meanwhile)
        wheel, sdist_names, wheel_names = _build(src, os.path.join(tmp, "dist"), os.path.join(tmp, "unpacked"))
        venv = os.path.join(tmp, "venv")
        python = _venv_with(wheel, venv)
        run_dir = os.path.join(tmp, "run")  # the cwd of what runs: outside the source tree
        os.makedirs(run_dir)
        yield {"sdist": sdist_names, "wheel": wheel_names, "package": package, "venv": venv, "python": python,
               "run_dir": run_dir}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_wheel_ships_every_module_of_the_package(built):
    shipped = {n[len("sparkhvd/"):] for n in built["wheel"] if n.startswith("sparkhvd/")}
    assert "collective/_core/_ops.py" in shipped
    assert shipped == built["package"], "the wheel and the checkout's package differ"


def test_the_sdist_holds_what_a_build_needs_and_no_litter(built):
    names = set(built["sdist"])
    package = {n for n in names if n.endswith(".py") and n != "setup.py"}
    assert "collective/_core/_ops.py" in package
    assert package == built["package"]
    litter = sorted(n for n in names if set(n.split("/")) & set(LITTER + NOT_THE_PACKAGE) or n.endswith(".pyc"))
    assert litter == []
    rest = {n for n in names - package if not n.startswith("sparkhvd.egg-info/")}
    assert rest == SDIST_TOP | ({"LICENSE"} if os.path.exists(os.path.join(ROOT, "LICENSE")) else set())
    assert {n.split("/", 1)[1] for n in names if n.startswith("sparkhvd.egg-info/")} <= EGG_INFO


def _public_modules(wheel_names: list) -> list:
    modules = []
    for name in wheel_names:
        if not (name.startswith("sparkhvd/") and name.endswith(".py")):
            continue
        parts = name[:-3].split("/")
        if parts[-1] == "__init__":
            parts.pop()
        if not any(p.startswith("_") for p in parts):
            modules.append(".".join(parts))
    return sorted(modules) + list(PRIVATE_IMPORTED)


IMPORT_ALL = """
import importlib, json, sys
files = {name: importlib.import_module(name).__file__ for name in sys.argv[1:]}
print(json.dumps(files))
"""


def test_every_public_module_imports_from_the_installed_wheel(built):
    modules = _public_modules(built["wheel"])
    assert {"sparkhvd", "sparkhvd.collective.torch", "sparkhvd.collective.tensorflow", "sparkhvd.collective.keras",
            "sparkhvd.data", "sparkhvd.runner", "sparkhvd.ml"} <= set(modules)
    out = _run([built["python"], "-c", IMPORT_ALL, *modules], cwd=built["run_dir"], env=_env(built))
    files = json.loads(out.stdout.splitlines()[-1])
    assert sorted(files) == sorted(modules)
    site = os.path.join(built["venv"], "lib")
    assert [m for m, f in files.items() if not f.startswith(site + os.sep)] == [], files["sparkhvd"]


def _env(built) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYSPARK_PYTHON=built["python"], PYSPARK_DRIVER_PYTHON=built["python"], VIRTUAL_ENV=built["venv"],
               PATH=os.path.join(built["venv"], "bin") + os.pathsep + env.get("PATH", ""),
               SPARKHVD_WARM="0")  # fresh rank processes of the new venv; no warm process to stop afterwards
    return env


TRAIN = """
    import json
    import sys

    import torch
    import sparkhvd
    import sparkhvd.collective.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
    print("WHEEL", hvd.rank(), hvd.size(), total.item(), sparkhvd.__file__, flush=True)
    print("ARGV", hvd.rank(), json.dumps(sys.argv[1:]), flush=True)
"""


def test_the_console_script_runs_a_spark_job_from_the_wheel(built):
    """``sparkhvd run --master --conf`` (the CLI's one Spark run in the suite: tests/runner/test_cli.py runs its
    others on local ranks or under spark-submit): the session it starts, and the script's own arguments."""
    with open(os.path.join(built["run_dir"], "train.py"), "w") as f:
        f.write(textwrap.dedent(TRAIN))
    sparkhvd = os.path.join(built["venv"], "bin", "sparkhvd")  # the console script pip wrote
    out = _run([sparkhvd, "run", "--np", "2", "--master", "local[2]", "--conf", "spark.ui.enabled=false", "train.py",
                "--lr", "0.1"], cwd=built["run_dir"], env=_env(built))
    assert "on a Spark barrier stage on local[2]" in out.stdout
    for rank in (0, 1):
        assert f'[{rank}] ARGV {rank} ["--lr", "0.1"]' in out.stdout, out.stdout[-3000:]
    rows = sorted(line.split() for line in out.stdout.splitlines() if " WHEEL " in line)  # "[0] WHEEL 0 2 3.0 ..."
    assert [r[:5] for r in rows] == [["[0]", "WHEEL", "0", "2", "3.0"], ["[1]", "WHEEL", "1", "2", "3.0"]], \
        out.stdout[-3000:]
    assert all(r[5].startswith(os.path.join(built["venv"], "lib") + os.sep) for r in rows), rows
