"""Re-run notebooks in place, so that the committed files carry the outputs of a real run.

    .venv/bin/python notebooks/execute.py notebooks/03_dataframe_to_training.ipynb [...]

Each notebook runs top to bottom in a fresh kernel of this interpreter (nbclient, ipykernel: the
`test` extra), in a temporary working directory. Then, to keep the files readable on a code host:
the cells' timing metadata is dropped, consecutive stream outputs are merged, and the JVM's
start-up notices (log4j, native-library and host-name warnings, which name this machine) are
left out of stderr. tests/test_notebooks.py checks the committed files for a whole run.

The outputs carry no path of this machine (tests/test_notebooks.py checks that too). The kernel
runs with ``TMPDIR`` set to a fresh temporary folder, so its temporary files, IPython's files of
the cells' code (``ipykernel_<pid>/<hash>.py``, in tracebacks) and sparkhvd's logs
(``SPARKHVD_LOG_ROOT=$TMPDIR/sparkhvd-logs``) all lie in it; in the outputs, that folder's path then
reads ``$TMPDIR``. Paths into the interpreter's packages read ``<site-packages>`` (a library's
warning names its file), the rest of its environment ``<venv>``, this checkout ``<checkout>``, and
the home folder ``~``. Nothing else in the outputs is rewritten.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

import nbclient
import nbformat
from ipykernel import kernelspec

#: stderr lines of Spark's JVM start-up: notices, not the notebook's output
JVM_NOISE = re.compile(r"^(WARNING: Using incubator modules|Using Spark's default log4j profile|Setting default log "
                       r"level to|To adjust logging level use|\d\d/\d\d/\d\d \d\d:\d\d:\d\d WARN |WARNING: An illegal|"
                       r"\[Stage \d+:)")


def execute(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    root = tempfile.mkdtemp(prefix="sparkhvd-notebooks-")
    tmp = os.path.join(root, "tmp")
    saved = dict(os.environ)
    try:
        kernelspec.write_kernel_spec(os.path.join(root, "share", "jupyter", "kernels", "python3"))
        os.mkdir(tmp)
        os.environ.update(JUPYTER_PATH=os.path.join(root, "share", "jupyter"),
                          JUPYTER_RUNTIME_DIR=os.path.join(root, "runtime"),
                          JUPYTER_DATA_DIR=os.path.join(root, "data"), IPYTHONDIR=os.path.join(root, "ipython"),
                          PYSPARK_PYTHON=sys.executable, TMPDIR=tmp,
                          SPARKHVD_LOG_ROOT=os.path.join(tmp, "sparkhvd-logs"))
        cwd = tempfile.mkdtemp(prefix="cwd-", dir=root)
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": cwd}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(root, ignore_errors=True)
    paths = _placeholders(tmp)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata.pop("execution", None)
            cell.outputs = _tidy(cell.outputs, paths)
    nbformat.write(nb, path)


def _placeholders(tmp: str) -> list:
    """``(absolute path, what it reads as in the outputs)``, longest first: a path inside another is replaced
    before it."""
    import site

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    named = {tmp: "$TMPDIR", sys.prefix: "<venv>", checkout: "<checkout>", os.path.expanduser("~"): "~"}
    named.update((folder, "<site-packages>") for folder in site.getsitepackages())
    for folder, placeholder in list(named.items()):
        named.setdefault(os.path.realpath(folder), placeholder)
    return sorted(((folder, placeholder) for folder, placeholder in named.items() if len(folder) > 1),
                  key=lambda pair: -len(pair[0]))


def _unplaced(text: str, paths: list) -> str:
    for folder, placeholder in paths:
        text = text.replace(folder + os.sep, placeholder + os.sep)
    return text


def _tidy(outputs: list, paths: list) -> list:
    kept = []
    for out in outputs:
        if out.output_type == "stream":
            text = "".join(_unplaced(line, paths) for line in out.text.splitlines(keepends=True)
                           if not (out.name == "stderr" and JVM_NOISE.match(line)))
            if not text:
                continue
            if kept and kept[-1].output_type == "stream" and kept[-1].name == out.name:
                kept[-1].text += text
                continue
            out.text = text
        elif "data" in out and "text/plain" in out.data:
            out.data["text/plain"] = _unplaced(out.data["text/plain"], paths)
        kept.append(out)
    return kept


if __name__ == "__main__":
    for name in sys.argv[1:]:
        execute(name)
        print(f"executed {name}")
