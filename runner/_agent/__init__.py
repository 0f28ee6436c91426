"""The task agent: what runs in each Spark task (or local launcher thread) of a run. It registers with the driver,
builds the rank's environment, starts the rank's process (forked from the warm process or a fresh Python), and
forwards its output. It runs in the Spark executor's Python worker. Tests: tests/runner/agent/.
"""
