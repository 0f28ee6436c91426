"""Re-run notebooks in place, so that the committed files carry the outputs of a real run.

    .venv/bin/python notebooks/execute.py notebooks/03_dataframe_to_training.ipynb [...]

Each notebook runs top to bottom in a fresh kernel of this interpreter (nbclient, ipykernel: the
`test` extra), in a temporary working directory. Then, to keep the files readable on a code host:
the cells' timing metadata is dropped, consecutive stream outputs are merged, and the JVM's
start-up notices (log4j, native-library and host-name warnings, which name this machine) are
left out of stderr. tests/test_notebooks.py checks the committed files for a whole run.
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
    try:
        kernelspec.write_kernel_spec(os.path.join(root, "share", "jupyter", "kernels", "python3"))
        os.environ.update(JUPYTER_PATH=os.path.join(root, "share", "jupyter"),
                          JUPYTER_RUNTIME_DIR=os.path.join(root, "runtime"),
                          JUPYTER_DATA_DIR=os.path.join(root, "data"), IPYTHONDIR=os.path.join(root, "ipython"),
                          PYSPARK_PYTHON=sys.executable)
        cwd = tempfile.mkdtemp(prefix="cwd-", dir=root)
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": cwd}}).execute()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata.pop("execution", None)
            cell.outputs = _tidy(cell.outputs)
    nbformat.write(nb, path)


def _tidy(outputs: list) -> list:
    kept = []
    for out in outputs:
        if out.output_type == "stream":
            text = "".join(line for line in out.text.splitlines(keepends=True)
                           if not (out.name == "stderr" and JVM_NOISE.match(line)))
            if not text:
                continue
            if kept and kept[-1].output_type == "stream" and kept[-1].name == out.name:
                kept[-1].text += text
                continue
            out.text = text
        kept.append(out)
    return kept


if __name__ == "__main__":
    for name in sys.argv[1:]:
        execute(name)
        print(f"executed {name}")
