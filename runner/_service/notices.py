"""Start-up notices that every rank's libraries print alike (TensorFlow's, on each import).

The driver shows each such notice once per run (the first rank's to arrive) and keeps every
rank's own copy in that rank's log file (runner/_service/logs.py). Each pattern matches one whole stderr
line exactly as the library prints it; a line that does not match is shown as always. Nothing
here changes what the libraries do (``TF_ENABLE_ONEDNN_OPTS`` changes TensorFlow's numerics and is
never set).
"""

from __future__ import annotations

import re

_ABSL_INFO = r"I\d{4} [\d:.]+ +\d+ "  # absl's prefix of an INFO line: I<mmdd> <time> <thread id> <file>:<line>]

#: name -> the whole line, as a regular expression
NOTICES = {
    # Printed by each of TensorFlow's two native libraries as it loads, before absl is set up (so
    # TF_CPP_MIN_LOG_LEVEL does not silence these two).
    "absl_before_init": r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    "tf_onednn": _ABSL_INFO + r"port\.cc:\d+\] oneDNN custom operations are on\. You may see slightly different "
                              r"numerical results .*`TF_ENABLE_ONEDNN_OPTS=0`\.",
    # TensorFlow built without some of this CPU's instructions: one message in two lines.
    "tf_cpu_feature_guard": _ABSL_INFO + r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use "
                                         r"available CPU instructions in performance-critical operations\.",
    "tf_cpu_instructions": r"To enable the following instructions: .+, in other operations, rebuild TensorFlow with "
                           r"the appropriate compiler flags\.",
    # The first tf.data generator dataset in a process.
    "tf_memory_patch": _ABSL_INFO + r"generator_dataset_op\.cc:\d+\] Memory patch applied: M_TRIM_THRESHOLD=.+ was "
                                    r"set\.",
}

_ANY = re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in NOTICES.items()))


def notice(line: str) -> str | None:
    """The name of the start-up notice ``line`` is, or None."""
    found = _ANY.fullmatch(line)
    return found.lastgroup if found else None
