"""The package's sub-packages, found at build time (pyproject.toml holds every other setting).

The repository root is the package ``sparkhvd`` (pyproject.toml: ``package-dir = {"sparkhvd" = "."}``).
pyproject.toml alone cannot find its sub-packages: ``[tool.setuptools.packages.find]`` names what it
finds relative to the folder it searches ("runner", never "sparkhvd.runner") and never that folder
itself, so a find there ships top-level ``runner``, ``collective``, ... and no ``sparkhvd``. A hand-kept
list instead once shipped a wheel without ``sparkhvd.collective._core``. So: find, then prefix.
"""

import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# Folders of the repository that are not the package (find_packages already skips dot-folders such
# as .venv and .git, and folders without an __init__.py).
NOT_THE_PACKAGE = [f"{name}{tail}" for name in ("tests", "bench", "notebooks", "docs", "build", "dist")
                   for tail in ("", ".*")]

setup(
    packages=["sparkhvd", *(f"sparkhvd.{name}" for name in find_packages(ROOT, exclude=NOT_THE_PACKAGE))],
    # This file sits in the package's folder: naming it keeps it out of the wheel (setuptools skips the
    # setup script among a package's modules, but a PEP 517 build would not tell it which file that is).
    script_name="setup.py",
)
