"""moto's S3 server on 127.0.0.1 for the tests: a real S3-protocol HTTP server, in the test's process (``s3`` in
tests/conftest.py) or in a process of its own (``s3_process_fixture``, for delta-rs)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading

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



class S3Process:
    """moto's S3 server in a process of its own on 127.0.0.1, and a bucket on it. delta-rs's reads hang against the
    in-process server (ThreadedMotoServer), so a Delta table's tests use this one."""

    bucket = S3Server.bucket
    filesystem = S3Server.filesystem  # pyarrow's S3 filesystem on its endpoint, as the in-process one gives it

    def __init__(self, timeout: float = 60.0):
        # Port 0: the server binds a free port and names it in werkzeug's "Running on http://127.0.0.1:<port>" line,
        # written once it listens (the handshake; no port picked here that another process could take first)
        self._process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True, errors="replace")
        self._said = collections.deque(maxlen=20)  # its last lines, for a message
        self._listening = threading.Event()
        self.port: int | None = None
        self._drain = threading.Thread(target=self._read_stderr, name="moto-server-stderr", daemon=True)
        self._drain.start()
        try:
            if not self._listening.wait(timeout) or self.port is None:
                raise RuntimeError(f"moto's S3 server (python -m moto.server, pid {self._process.pid}) did not say it "
                                   f"listens within {timeout} s (exit status {self._process.poll()}); it said: "
                                   f"{' | '.join(self._said) or 'nothing'}")
            self.host = "127.0.0.1"
            self.endpoint = f"{self.host}:{self.port}"
            self.filesystem().create_dir(self.bucket)
        except BaseException:
            self.stop()
            raise

    def _read_stderr(self) -> None:
        """Every line the server writes (a line per request too), so that its pipe never fills."""
        for line in self._process.stderr:
            self._said.append(line.strip())
            found = re.search(r"Running on http://127\.0\.0\.1:(\d+)", line)
            if found and self.port is None:
                self.port = int(found.group(1))
                self._listening.set()
        self._listening.set()  # it exited

    def storage_options(self) -> dict:
        """delta-rs's options for the server: its endpoint over http, the region, the environment's credentials."""
        return {"AWS_ENDPOINT_URL": f"http://{self.endpoint}", "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"]}

    def stop(self) -> None:
        """End the server and wait for it (killed if it has not ended 10 s after SIGTERM)."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._drain.join(10)
        self._process.stderr.close()


# The environment's settings that would tell delta-rs or pyarrow where S3 is: a test passes them in storage_options
_S3_ENVIRONMENT = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_ALLOW_HTTP", "AWS_REGION",
                   "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_SESSION_TOKEN")


def s3_process_fixture(secret: str = "sparkhvd-test-secret"):
    """moto's S3 server in a process of its own for the module, with test credentials in the usual environment
    variables (``secret`` the secret key), and no endpoint or region there (a test passes them itself)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]' installs it)")
    with pytest.MonkeyPatch.context() as env:
        for name in _S3_ENVIRONMENT:
            env.delenv(name, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", "sparkhvd-test-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", secret)
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata service to ask for a region here
        server = S3Process()
        try:
            yield server
        finally:
            server.stop()
