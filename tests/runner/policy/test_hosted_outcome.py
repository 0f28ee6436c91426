"""A hosted attempt's outcome (runner/_policy/hosted.py): the blob that comes back in the stage's rows is unpickled
only once it verifies under the run's secret, and task 0's commits keep the driver's newness rule. (The hosted
runs themselves: tests/runner/backends/test_spark_connect.py, and on the testbed tests/cluster/test_cluster_connect.py.)"""

from __future__ import annotations

import pytest

from sparkhvd.runner._policy.hosted import _TaskCommits
from sparkhvd.runner._shared.signed import CHUNK_BYTES, chunks, expected_size, sign, verified

pytestmark = pytest.mark.unit

SECRET = b"s" * 32


def test_a_signed_blob_cut_in_rows_verifies_whole():
    body = bytes(range(256)) * (CHUNK_BYTES // 128)  # two rows and a bit
    rows = chunks(sign(SECRET, body))
    assert len(rows) == 3 and expected_size(rows[0]) == sum(map(len, rows))
    assert verified(SECRET, b"".join(rows)) == body


@pytest.mark.parametrize("spoil", [
    lambda blob: blob[:-1],  # cut short
    lambda blob: blob[:-1] + bytes([blob[-1] ^ 1]),  # one bit altered
    lambda blob: blob[:10],  # shorter than its header
    lambda blob: sign(b"t" * 32, blob[40:]),  # another run's secret
])
def test_rows_that_do_not_verify_are_refused_before_anything_is_unpickled(spoil):
    blob = sign(SECRET, b"\x80\x05K\x01.")  # a pickle: it must never be loaded unverified
    with pytest.raises(ValueError) as info:
        verified(SECRET, spoil(blob))
    assert "do not verify under the run's secret" in str(info.value) and "none of it was unpickled" in str(info.value)


def test_task_commits_start_from_the_earlier_attempts_and_keep_only_newer_ones_for_the_client():
    commits = _TaskCommits([({"key": "state", "seq": 3}, b"old", 0)])
    assert commits.attempt_of("state") == 0 and commits.get("state").data() == b"old"
    assert commits.put({"key": "state", "seq": 1}, b"new", attempt=1)  # a new attempt's first commit wins
    assert not commits.put({"key": "state", "seq": 1}, b"same", attempt=1)  # not newer within the attempt
    assert commits.put({"key": "state", "seq": 2}, b"newer", attempt=1)
    assert commits.sent == {"state": ({"key": "state", "seq": 2}, b"newer", 1)}  # the newest, for the client
