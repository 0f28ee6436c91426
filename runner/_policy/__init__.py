"""The run's policy: the state machine over attempts (``policy.py``), one attempt's rules (``supervise.py``), what a
failure says (``failure_report.py``), the stall inspector and its report, and what a run gives back
(``result.py``). It runs in the driver, reads the service's frozen ``RunStatus`` snapshots and reaches the world
only through the backend contract (``_backends/api.py``): no sockets, no Spark, so fakes drive every transition
in milliseconds. Tests: tests/runner/policy/.
"""
