"""``needs(...)``: skip a module's tests where an optional library is not installed, without importing it.

``pytest.importorskip`` imports the library while the module is collected, in every pytest-xdist worker:
TensorFlow, DeepSpeed (with the MLflow it imports), Lightning and transformers cost about 15 CPU-seconds
per worker on the 2-core machine, though their tests run them in rank processes.
"""

from __future__ import annotations

import importlib.util

import pytest


def needs(*modules: str, reason: str | None = None):
    """A skip mark for where one of the top-level ``modules`` is not installed (found, not imported)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=reason or f"{', '.join(missing)} isn't installed")
