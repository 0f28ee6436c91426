"""The rank process: the worker that fetches the function and runs it, its heartbeat, how it ends (the driver's
abort, its agent's death) and reports a failure, ``log_to_driver``, and Horovod's module aliases. It runs in
the rank's own process, forked or fresh. Tests: tests/runner/rank/.
"""
