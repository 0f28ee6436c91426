"""sparkhvd.data imports no framework, and the TensorFlow adapter says how to install TensorFlow."""

from __future__ import annotations

import subprocess
import sys


def test_import_sparkhvd_data_imports_no_torch_pyspark_or_tensorflow():
    code = "import sys, sparkhvd.data; print(*(m in sys.modules for m in ('torch', 'pyspark', 'tensorflow')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_tensorflow_adapter_without_tensorflow_says_how_to_install_it():
    # None in sys.modules makes `import tensorflow` fail as if it were not installed.
    code = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "try:\n"
        "    import sparkhvd.data.tensorflow\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name, exc, sep='|')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "tensorflow|TensorFlow isn't installed: pip install 'sparkhvd[tensorflow]'"
