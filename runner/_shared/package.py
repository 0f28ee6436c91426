"""Where the sparkhvd package is installed: the folder of its top ``__init__.py``.

Named through the package, never by counting folders up from a module's own file, so moving a module cannot
silently point a path at one sub-package (the warm process's key hashes every file under it; a rank's
traceback hides the frames under it).
"""

from __future__ import annotations

import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(sys.modules[__name__.partition(".")[0]].__file__))
