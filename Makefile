# make demo: set up .venv (once) and run the demo.  make test: set up .venv (once) and run the tests.
# make check: the fast tier alone (tests marked unit: no process, no Spark), in well under a minute.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test check coverage bench check-python check-java clean

demo: check-java $(STAMP)
	$(VPY) notebooks/demo.py

# Four workers: most tests wait on processes, the JVM and the network, not on the 2 cores (at three, a fresh
# clone's suite kept them under half busy).
test: check-java $(STAMP)
	$(VPY) -m pytest -n 4 $(PYTEST_ARGS)

# The fast tier: pure logic against fakes (pytest -m unit; tests/conftest.py fails a unit test that starts a process,
# a HorovodRunner or Spark). In test order, so a failure reproduces.
check: $(STAMP)
	$(VPY) -m pytest -m unit -q -p no:randomly $(PYTEST_ARGS)

# The whole suite under coverage.py (pyproject's [tool.coverage.*]); prints the line coverage.
coverage: check-java $(STAMP)
	rm -f .coverage .coverage.*
	COVERAGE_FILE=$(CURDIR)/.coverage $(VPY) -m coverage run -m pytest -n 4 $(PYTEST_ARGS) || true
	$(VPY) -m coverage combine -q || true  # a process killed while writing leaves a partial file: skipped
	$(VPY) -m coverage report --precision=2 | grep "^TOTAL"  # not tail -1: skip_empty adds a line after it

bench: check-java $(STAMP)
	$(VPY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,bench]"
	$(VPY) bench/launch.py
	$(VPY) bench/reader.py

check-python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: sparkhvd needs Python 3.10+ but $(PYTHON) is " + sys.version.split()[0] + "; run make PYTHON=python3.11 (or another 3.10+ interpreter).")'

check-java:
	@$(PYTHON) runner/_backends/java.py

# Reinstalled only when the package's requirements, its build (setup.py) or the pins change.
$(STAMP): pyproject.toml setup.py constraints.txt | check-python check-java
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	@touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
