"""What every process of a run reads alike (the driver, the agent, the rank): the run's exceptions, how an error
is classified (cause or collateral) and the one place its text is read, what a host is, the frameworks'
environment, the stall settings a heartbeat forwards, and start-up deadlines. It imports nothing of runner.
Tests: tests/runner/shared/.
"""
