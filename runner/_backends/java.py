"""Spark 4 needs Java 17+: find out in one sentence before Spark prints a wall of text."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

MIN_JAVA = 17


class JavaNotFoundError(RuntimeError):
    """No usable Java for Spark."""


def java_version(java: str) -> int | None:
    """The major version ``java -version`` reports, or None if it cannot be read."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def check_java() -> None:
    """Raise JavaNotFoundError unless Spark's java (JAVA_HOME, else PATH) is 17 or newer."""
    # Read here, not through _common/settings.py (JAVA_HOME there): `make check-java` runs this file alone, with
    # the system's Python, before sparkhvd is installed.
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    where = f"JAVA_HOME={home}" if home else "PATH"
    fix = ("install Java 17 or newer (e.g. `apt-get install openjdk-17-jre-headless`) "
           "and put it on PATH or set JAVA_HOME to it")
    if not java or not os.path.exists(java):
        raise JavaNotFoundError(f"Spark needs Java {MIN_JAVA}+ but no java was found on {where}; {fix}.")
    version = java_version(java)
    if version is None:
        raise JavaNotFoundError(f"Spark needs Java {MIN_JAVA}+ but `{java} -version` could not be read; {fix}.")
    if version < MIN_JAVA:
        raise JavaNotFoundError(f"Spark needs Java {MIN_JAVA}+ but {java} (from {where}) is Java {version}; {fix}.")


if __name__ == "__main__":  # used by the Makefile
    import sys

    try:
        check_java()
    except JavaNotFoundError as exc:
        sys.exit(f"error: {exc}")
