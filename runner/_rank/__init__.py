"""The rank process: the worker that fetches the function and runs it, its heartbeat, how it ends (the driver's
abort, its agent's death) and reports a failure, ``log_to_driver``, and Horovod's module aliases. It runs in
the rank's own process, forked or fresh; ``startup.prepare`` is the process state both start with. Tests:
tests/runner/rank/, and the runs in tests/runner/ (test_ranks_on_the_driver.py, test_faults.py).
"""
