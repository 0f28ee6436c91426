"""moto's S3 server on 127.0.0.1 for the tests (``s3`` in tests/conftest.py): a real S3-protocol HTTP server."""

from __future__ import annotations

import pytest


class S3Server:
    """moto's S3 server on 127.0.0.1 (a real S3-protocol HTTP server, in this process), and a bucket on it."""

    bucket = "sparkhvd-test"

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._server_type = ThreadedMotoServer
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        self.endpoint = f"{self.host}:{self.port}"
        self.filesystem().create_dir(self.bucket)

    def filesystem(self, **options):
        """pyarrow's S3 filesystem on the server; ``options`` as S3FileSystem takes them."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", region="us-east-1",
                                 allow_bucket_creation=True, **options)

    def url(self, key: str) -> str:
        """An ``s3://`` URL of ``key`` in the bucket, with the endpoint in its query (credentials from the environment)."""
        return f"s3://{self.bucket}/{key}?endpoint_override={self.endpoint}&scheme=http&region=us-east-1"

    def stop(self) -> None:
        self._server.stop()

    def start_again(self) -> None:
        """A new server on the same port; moto keeps the objects in this process, so they are all there."""
        self._server = self._server_type(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()


def s3_fixture():
    """A moto S3 server for the module, with credentials in the usual environment variables (never in a URL)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]' installs it)")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "sparkhvd-test-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", "sparkhvd-test-secret")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = S3Server()
        try:
            yield server
        finally:
            server.stop()
