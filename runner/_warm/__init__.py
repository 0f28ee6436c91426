"""The warm process, the zygote: a Python that has imported torch once and forks ranks on request from the
agents of the same user. Its key, socket protocol, client (in the agent), server, and the child that becomes
the rank. It runs beside the executors, detached. Tests: tests/runner/warm/.
"""
