"""An S3-compatible server for the remote-storage tests: moto's server mode on a free localhost port.

``s3_server()`` starts it in a thread of this process and yields an ``S3`` record: its endpoint and the environment
a client needs (dummy credentials, ``AWS_ENDPOINT_URL``, which botocore, and so s3fs, reads itself). Nothing
leaves the machine: the credentials are dummies, and botocore reads no config file and asks no metadata address. ``with s3.env():`` sets that environment in this process; ``train_job_with_env`` does it in a
worker of the pool (tests/support/pool.py), whose environment is the forkserver's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

BUCKET = "torchtitan-ckpt"


@dataclass(frozen=True)
class S3:
    endpoint: str

    @property
    def environ(self) -> dict[str, str | None]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            # botocore's credential chain would read the user's files and ask the EC2 metadata address: neither
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": None,
            "AWS_CONTAINER_CREDENTIALS_FULL_URI": None,
            "AWS_PROFILE": None,
        }

    @contextlib.contextmanager
    def env(self, **changes: str | None) -> Iterator[None]:
        """This environment (with ``changes``; None removes a variable) while inside, and fresh s3fs sessions."""
        with environ({**self.environ, **changes}):
            yield

    def require_auth(self, on: bool) -> None:
        """Make the server check every request's credentials against its (empty) IAM: any key is then unknown."""
        import requests

        requests.post(
            f"{self.endpoint}/moto-api/reset-auth", data=b"0" if on else b"inf", timeout=10
        ).raise_for_status()


@contextlib.contextmanager
def environ(changes: dict[str, str | None]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in changes}
    _set(changes)
    _forget_sessions()
    try:
        yield
    finally:
        _set(saved)
        _forget_sessions()


def _set(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _forget_sessions() -> None:
    """s3fs caches one filesystem (and its credentials and endpoint) per set of options: drop them."""
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_server() -> Iterator[S3]:
    """moto's S3 on 127.0.0.1 with the bucket ``BUCKET`` made."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = S3(f"http://127.0.0.1:{port}")
    try:
        import requests

        # moto keeps its buckets per process, not per server: start from none
        requests.post(f"{s3.endpoint}/moto-api/reset", timeout=10).raise_for_status()
        with s3.env():
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        yield s3
    finally:
        server.stop()


def train_job_with_env(
    rank: int, world_size: int, environ_: dict[str, str | None], argv: list[str], builders: Any = None
) -> Any:
    """tests/support/pool.py's ``train_job`` with ``environ_`` set in this worker for the job's length."""
    from tests.support.pool import train_job

    with environ(environ_):
        return train_job(rank, world_size, argv, builders)
