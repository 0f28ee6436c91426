"""``import sparkhvd.migrate``: the one line that lets code written for Horovod and Databricks' HorovodRunner run
on sparkhvd as it is.

Put it first in the notebook (or driver script). It installs, in this process, the aliases every
rank sparkhvd starts already has (runner/_rank/aliases.py): ``from sparkdl import HorovodRunner`` gets
sparkhvd's drop-in, ``import horovod.torch as hvd`` (``horovod.tensorflow``, ``horovod.keras``, ...)
gets ``sparkhvd.collective.torch`` (...), and ``horovod.spark.run`` runs on HorovodRunner. A real
``horovod`` or ``sparkdl`` that is installed keeps winning (with a warning saying so), and
``SPARKHVD_HOROVOD_ALIASES=0`` turns the aliases off. See docs/migration.md.
"""

from .runner._rank.aliases import install_on_driver as _install_on_driver

_install_on_driver()
