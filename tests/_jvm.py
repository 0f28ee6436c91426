"""The options of the JVMs the suite starts, and the archive of Spark's classes they share.

Short-lived JVMs that start quickly and leave the 2 cores to the ranks: C1 only, one collector thread, no
verification of Spark's own jars' bytecode (tests/conftest.py gives them to every pyspark driver, here or in a
subprocess, to spark-submit's and to their executors; tests/cluster/ to its daemons and executors).

And a class-data-sharing archive (JDK's AppCDS, ``-XX:SharedArchiveFile``) of the classes a pyspark driver loads:
a JVM that maps it skips parsing and linking them. Built once per ``make test`` (``python tests/_jvm.py <path>``,
started by tests/conftest.py in the pytest-xdist controller, about 20 CPU-seconds), beside the workers' start;
each JVM with the same class path started after it is written maps it. One that starts earlier, or whose class
path differs (the testbed's daemons, with their conf folder first), runs as without it: the file missing or not
matching is not an error, and ``-Xlog:cds`` is off so that no JVM prints a word about it.
"""

from __future__ import annotations

import os
import sys
import tempfile

BASE_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
ARCHIVE_ENV = "SPARKHVD_TEST_JVM_ARCHIVE"  # the archive's path, for the processes the suite starts


def archive_opts(path: str | None = None) -> str:
    """The options that map the archive at ``path`` (default: ``$SPARKHVD_TEST_JVM_ARCHIVE``), or ``""``."""
    path = path or os.environ.get(ARCHIVE_ENV)
    return f"-XX:SharedArchiveFile={path} -Xlog:cds=off -Xlog:cds+dynamic=off" if path else ""


def opts() -> str:
    """What every driver and executor JVM of the suite is given."""
    return f"{BASE_OPTS} {archive_opts()}".strip()


def build(path: str) -> None:
    """Run a pyspark driver through what the tests' drivers do (SQL, Parquet, Arrow, Python and barrier jobs);
    its JVM writes the classes it loaded to ``path`` as it exits (to ``path.part``, then renamed: a JVM never
    maps half a file)."""
    part = path + ".part"
    # java.io.tmpdir: the session's temp dir (TMPDIR), so that a JVM a short run kills (pytest_unconfigure) leaves its
    # spark-*/blockmgr-* folders there, removed with it, and not in /tmp
    os.environ["PYSPARK_SUBMIT_ARGS"] = (f"--driver-java-options '{BASE_OPTS} -Djava.io.tmpdir={tempfile.gettempdir()} "
                                         f"-XX:ArchiveClassesAtExit={part} -Xlog:cds=off -Xlog:cds+dynamic=off' "
                                         "pyspark-shell")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.pop("SPARK_SUBMIT_OPTS", None)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("sparkhvd-tests-jvm-archive")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    folder = os.path.join(os.path.dirname(path), "jvm-archive-parquet")
    df = spark.createDataFrame([(i, float(i)) for i in range(100)], ["id", "x"])
    df.write.mode("overwrite").parquet(folder)
    back = spark.read.parquet(folder)
    back.groupBy((back.id % 2).alias("k")).sum("x").collect()
    back.toPandas()
    spark.sparkContext.parallelize(range(4), 2).barrier().mapPartitions(lambda it: [sum(it)]).collect()
    gateway = spark.sparkContext._gateway
    spark.stop()
    gateway.proc.stdin.close()  # the JVM exits (and writes the archive) when its stdin closes
    gateway.proc.wait(120)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    if os.path.exists(part):
        os.rename(part, path)


if __name__ == "__main__":
    build(sys.argv[1])
