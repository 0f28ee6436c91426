"""Where the tests' own files are, for test files in any folder under tests/ (on sys.path through tests/conftest.py)."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/: the helpers (_cases.py, ...) and scripts/
ROOT = os.path.dirname(TESTS)  # the repository: the sparkhvd package's source
SCRIPTS = os.path.join(TESTS, "scripts")
