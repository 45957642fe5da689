"""Fixtures of the integration tests beyond tests/conftest.py: a real local S3 server.

`s3`: moto's S3 in server mode (its werkzeug app on a free port, in a thread of the test
process) with one bucket, shared by the session; every request it serves is recorded
(method, path, Range), so a test can see which keys a store asked for and in what ranges.
Worker and API processes reach it over HTTP like any S3-compatible endpoint.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo

BUCKET = "e31-test"
ACCESS_KEY = "e31-test-key"
SECRET_KEY = "e31-test-secret-do-not-leak"  # moto takes any; a test looks for it in job envs


@dataclass(frozen=True)
class S3Request:
    method: str
    key: str             # the object's key (the path without the bucket), as the server saw it
    range: str | None    # the Range header, e.g. "bytes=0-2097151"


@dataclass
class S3Server:
    endpoint: str
    bucket: str = BUCKET
    requests: list[S3Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, method: str, path: str, range_: str | None) -> None:
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket == self.bucket:
            with self._lock:
                self.requests.append(S3Request(method, key, range_))

    def take(self) -> list[S3Request]:
        """The requests served since the last call, and forget them."""
        with self._lock:
            taken, self.requests[:] = list(self.requests), []
        return taken

    @property
    def options(self) -> dict[str, Any]:
        """s3fs's arguments for this server (what `e31.edge.wiring.storage_options` builds)."""
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def env(self) -> dict[str, str]:
        """The E31_* settings that point a process's artifact store at this server."""
        return {"E31_S3_ENDPOINT_URL": self.endpoint, "E31_S3_ACCESS_KEY_ID": ACCESS_KEY,
                "E31_S3_SECRET_ACCESS_KEY": SECRET_KEY}

    def client(self) -> Any:
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                         Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    pytest.importorskip("s3fs", reason="the s3 extra is not installed")
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = DomainDispatcherApplication(create_backend_app)
    server: S3Server | None = None

    def recording(environ: dict[str, Any], start_response: Any) -> Any:
        assert server is not None
        server.record(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                      environ.get("HTTP_RANGE"))
        return app(environ, start_response)

    httpd = make_server("127.0.0.1", 0, recording, threaded=True)
    server = S3Server(endpoint=f"http://127.0.0.1:{httpd.server_address[1]}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        httpd.shutdown()
        thread.join(timeout=10)


@pytest.fixture
def s3_url(s3: S3Server) -> str:
    """A fresh prefix of the bucket for one test: `s3://e31-test/<random>`."""
    return f"s3://{posixpath.join(s3.bucket, 't-' + uuid.uuid4().hex[:10])}"


def bearer(token: str) -> dict[str, str]:
    """The header of a request made with `token`."""
    return {"Authorization": f"Bearer {token}"}


MakeApp = Callable[..., FastAPI]


@pytest.fixture
def make_app(repo: Repo, redis_url: str, redis_client: redis.Redis,
             tmp_path: Path) -> MakeApp:
    """The API app over the test's store and Redis, with `settings` overriding the defaults;
    each call a process of its own (its own Services)."""
    def make(**settings: Any) -> FastAPI:
        s = Settings(redis_url=redis_url, home=tmp_path, **settings)
        service = Services(settings=s, repo=repo,
                          artifacts=ArtifactStore(f"file://{tmp_path / 'artifacts'}"),
                          redis_client=redis_client)
        return create_app(s, services=service)
    return make


@pytest.fixture
def api(make_app: MakeApp) -> TestClient:
    """The real API app over the test's store and Redis, in process (modules with an `api`
    fixture of their own shape keep theirs)."""
    return TestClient(make_app())
