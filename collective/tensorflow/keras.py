"""``horovod.tensorflow.keras`` becomes ``sparkhvd.collective.tensorflow.keras``: the same module
as ``sparkhvd.collective.keras`` (Keras 3), under the path Horovod users import.

``sparkhvd.collective.tensorflow.keras.callbacks`` and ``.elastic`` are registered as importable names
too, so ``from sparkhvd.collective.tensorflow.keras.callbacks import ...`` works as with Horovod.
"""

from __future__ import annotations

import sys

from ..keras import *  # noqa: F403 - the alias re-exports the Keras API as it is
from ..keras import __all__, callbacks, elastic  # noqa: F401

sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic
