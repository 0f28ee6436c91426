"""Where ranks run: the launcher contract (``api.py``), the choice of a backend (``registry.py``), and one module each
for processes on the driver (``local.py``), a Spark barrier stage (``spark.py``, with its pre-flight, what Spark
says, and the Java check) and a Spark Connect session (``connect.py``). They run in the driver; only this package
and the public face import pyspark. Tests: tests/runner/backends/.
"""
