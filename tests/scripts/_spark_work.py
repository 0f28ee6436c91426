"""local-cluster's workers keep each application's files under $SPARK_HOME/work/<app id>: for pip's pyspark,
inside the installed package. Test drivers remove their application's folder when they stop."""

import os
import shutil


def remove_app_work_dir(app_id: str) -> None:
    from pyspark.find_spark_home import _find_spark_home

    shutil.rmtree(os.path.join(_find_spark_home(), "work", app_id), ignore_errors=True)
