"""A blob signed with a run's secret, as a hosted attempt's outcome travels in a Spark stage's rows
(runner/_policy/hosted.py writes and reads it; runner/_backends/connect_hosted.py carries it): a header of its
length and HMAC-SHA256, then the body, cut in rows of ``CHUNK_BYTES``."""

from __future__ import annotations

import hashlib
import hmac
import struct

CHUNK_BYTES = 4 << 20  # Spark Connect's Arrow batches are about as large
_HEADER = struct.Struct(">Q32s")


def sign(secret: bytes, body: bytes, label: bytes = b"") -> bytes:
    """``body`` behind a header of its length and HMAC-SHA256 under ``secret`` of ``label`` and the body (``label``:
    what the bytes are, which the reader checks them for; it does not travel)."""
    return _HEADER.pack(len(body), _tag(secret, label, body)) + body


def _tag(secret: bytes, label: bytes, body: bytes) -> bytes:
    mac = hmac.new(secret, len(label).to_bytes(4, "big") + label, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def chunks(blob: bytes) -> list:
    """``blob`` in rows of at most ``CHUNK_BYTES``, the header in the first."""
    return [blob[i:i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]


def expected_size(first: bytes) -> int:
    """The whole blob's size, from its first row."""
    return _HEADER.size + _HEADER.unpack_from(first)[0]


def verified(secret: bytes, blob: bytes, label: bytes = b"") -> bytes:
    """The body of a signed blob; ValueError where its signature does not verify under ``secret`` for ``label``."""
    size, tag = _HEADER.unpack_from(blob) if len(blob) >= _HEADER.size else (-1, b"")
    body = blob[_HEADER.size:]
    if len(body) != size or not hmac.compare_digest(tag, _tag(secret, label, body)):
        raise ValueError(f"the {len(blob)} bytes that came back in the Spark stage's rows do not verify under the "
                         "run's secret (they were cut short or altered on the way, or come from another run), so none "
                         "of it was unpickled; run it again, and if it happens again, look at what sits between the "
                         "cluster and this client.")
    return body
