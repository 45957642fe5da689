"""An http(s) input cannot be turned against the pool: the worker stages an input from its own
network, so an input naming the pool's loopback (`http://127.0.0.1:<flower>/metrics`) or a
private or link-local address is refused, at submit where the URL shows it and by the worker
on the address it connects to, after every redirect, unless an operator allows that network
(`input_allowed_networks`). Real HTTP servers on loopback, the worker's own staging code and
task body, the real API over a real store."""

from __future__ import annotations

import dataclasses
import socket
import socketserver
import ssl
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self, cast

import pytest
import redis
from fastapi.testclient import TestClient

from e31.core.clock import utcnow
from e31.core.errors import SetupError
from e31.core.records import Claim
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from e31_worker.attempt import task
from e31_worker.attempt.inputs import stage_inputs
from e31_worker.attempt.plan import AttemptPlan
from e31_worker.attempt.services import AttemptServices
from tests.integration.conftest import MakeApp, bearer
from tests.integration.test_store import publish
from tests.integration.test_task import services

SECRET = b"flower_events_total{worker=\"gpu0\"} 42  # the pool's own metrics\n"


class _Httpd(ThreadingHTTPServer):
    def server_bind(self) -> None:
        """Bind without http.server's reverse lookup of the address (`getfqdn`), which waits
        for a DNS timeout on 127.0.0.2 where no resolver answers."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]


class Quiet(BaseHTTPRequestHandler):
    """A test server's request handler that logs nothing."""

    def log_message(self, *args: Any) -> None:
        pass


class Serving:
    """A real HTTP server in a thread for a test, from `with` to its end; `base` is its URL.
    The servers of the input, pool-failure and index tests are this with a handler each."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.httpd = _Httpd((host, port), handler)
        self.base = f"http://{host}:{self.httpd.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Server(Serving):
    """A real HTTP server on one loopback address, in a thread: `/go?to=URL` answers 302 to
    URL, any other path `body` (SECRET); every path it was asked for is in `asked`."""

    def __init__(self, host: str, port: int = 0, body: bytes = SECRET) -> None:
        asked: list[str] = []

        class Handler(Quiet):
            def do_GET(self) -> None:
                asked.append(self.path)
                if self.path.startswith("/go?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path.removeprefix("/go?to="))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.asked = asked
        super().__init__(Handler, host, port)
        self.url = self.base


@pytest.fixture
def pool_service() -> Iterator[Server]:
    """The pool's own service on 127.0.0.1 (Flower's /metrics, say)."""
    with Server("127.0.0.1") as server:
        yield server


@pytest.fixture
def redirector() -> Iterator[Server]:
    """A server on 127.0.0.2 that a tenant controls, which redirects."""
    with Server("127.0.0.2") as server:
        yield server


def stage(source: str, root: Path, allowed: tuple[str, ...] = ()) -> Path:
    """Stage one input `stolen` as the worker's prepare stage does, on a pool that allows
    `allowed`; returns where it lands."""
    settings = Settings(redis_url="redis://unused", input_allowed_networks=allowed)
    spec = JobSpec.parse({"entrypoint": "m:f", "inputs": {"stolen": source}})
    plan = AttemptPlan(job_id="j-x", attempt=1, spec=spec, gpus="", root=root,
                       kill_grace_s=1.0, log_max_bytes=1 << 20, tick_interval_s=1.0)
    claim = Claim(job_id="j-x", tenant_id="t-x", token=1, attempt=1, spec=spec, gpus=0)
    stage_inputs(cast(AttemptServices, SimpleNamespace(settings=settings)), claim, plan)
    return plan.input_dir / "stolen"


def submit(repo: Repo, tenant_id: str, **fields: Any) -> str:
    """A cpu job of the tenant, queued; its id."""
    spec = JobSpec.parse({"resources": {"gpus": 0}, **fields})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes),
                           now=utcnow()).id


def test_the_worker_refuses_an_input_on_its_loopback_and_fetches_it_once_allowed(
        pool_service: Server, tmp_path: Path) -> None:
    # Given an input naming a service on the worker's loopback (the API's check bypassed)
    source = f"{pool_service.url}/secret"

    # When the worker stages it on a pool that allows no private network
    with pytest.raises(SetupError) as refused:
        stage(source, tmp_path / "a")

    # Then it is refused, naming the input and the address, and nothing was asked or staged
    assert refused.value.message.startswith("inputs.stolen: refused http://127.0.0.1:")
    assert "127.0.0.1 is a loopback address" in refused.value.message
    assert "input_allowed_networks" in refused.value.message
    assert pool_service.asked == []
    assert not (tmp_path / "a" / "inputs" / "stolen").exists()

    # And with the protection off for loopback (the operator allows 127.0.0.0/8), the same
    # fetch stages the secret: the refusal above is what kept it out
    staged = stage(source, tmp_path / "b", allowed=("127.0.0.0/8",))
    assert staged.read_bytes() == SECRET
    assert pool_service.asked == ["/secret"]


def test_a_redirect_to_the_loopback_is_refused_at_the_hop_and_followed_once_allowed(
        pool_service: Server, redirector: Server, tmp_path: Path) -> None:
    # Given an input on an address the pool allows (127.0.0.2) that redirects to the pool's
    # own service on 127.0.0.1
    source = f"{redirector.url}/go?to={pool_service.url}/secret"

    # When the worker stages it on a pool that allows 127.0.0.2 alone
    with pytest.raises(SetupError) as refused:
        stage(source, tmp_path / "a", allowed=("127.0.0.2/32",))

    # Then the first hop was fetched, the redirect's target was refused at its connection
    # (naming it, the address and where it came from), and the secret was never asked for
    message = refused.value.message
    assert message.startswith(f"inputs.stolen: refused {pool_service.url}/secret "
                              f"(redirected from {source})"), message
    assert "127.0.0.1 is a loopback address" in message
    assert redirector.asked == [f"/go?to={pool_service.url}/secret"]
    assert pool_service.asked == []
    assert not (tmp_path / "a" / "inputs" / "stolen").exists()

    # And where the operator allows all of loopback, the redirect is followed
    staged = stage(source, tmp_path / "b", allowed=("127.0.0.0/8",))
    assert staged.read_bytes() == SECRET
    assert pool_service.asked == ["/secret"]


def test_a_host_name_that_resolves_to_the_loopback_is_refused_by_the_worker(
        pool_service: Server, tmp_path: Path) -> None:
    # Given an input that names the loopback by a name the API lets through (the worker
    # resolves it; `localhost` stands for any name whose DNS answers 127.0.0.1)
    source = f"http://localhost:{pool_service.httpd.server_address[1]}/secret"

    # When the worker stages it, Then the address the name resolved to is refused
    with pytest.raises(SetupError) as refused:
        stage(source, tmp_path / "a")
    assert "localhost resolves to" in refused.value.message
    assert "a loopback address" in refused.value.message
    assert pool_service.asked == []


def test_a_name_whose_dns_answer_changes_after_the_check_is_fetched_from_the_checked_address(
        pool_service: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a public-data server on 127.0.0.2 (allowed) on the same port as the pool's own
    # service on 127.0.0.1, and a DNS that answers 127.0.0.2 for a name once, then 127.0.0.1
    # (DNS rebinding: the first answer passes the check, a second one would reach the pool)
    port = pool_service.httpd.server_address[1]
    lookups: list[str] = []
    resolve = socket.getaddrinfo

    def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "data.rebind.test":
            return resolve(host, *args, **kwargs)
        lookups.append(host)
        return resolve("127.0.0.2" if len(lookups) == 1 else "127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with Server("127.0.0.2", port, body=b"public data\n") as public:
        # When the worker stages the name's URL on a pool that allows 127.0.0.2 alone
        staged = stage(f"http://data.rebind.test:{port}/secret", tmp_path / "a",
                       allowed=("127.0.0.2/32",))

    # Then the name was resolved once, and the data came from the address that was checked
    assert lookups == ["data.rebind.test"]
    assert staged.read_bytes() == b"public data\n"
    assert public.asked == ["/secret"] and pool_service.asked == []


def test_a_refused_input_fails_the_attempt_with_reason_setup_and_no_retry(
        pool_service: Server, repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job with retries to spare whose input names the worker's loopback, and a job
    # command that would copy it out
    copied = tmp_path / "copied"
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    job_id = submit(repo, tenant.id, command=["sh", "-c", f'cat "$E31_INPUT_DIR/m" > {copied}'],
                       inputs={"m": f"{pool_service.url}/secret"}, retries={"max": 3})
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))

    # When a worker runs it
    task.run_job(svc, job_id, publish(repo, job_id))

    # Then the job failed at once with the user's reason setup, naming the input and the
    # address, and the command never ran
    record = repo.get_job(None, job_id)
    assert record.state == "failed" and len(record.attempts) == 1
    status = record.to_status()
    assert status["reason"] == "setup"
    assert "inputs.m: refused" in status["error"] and "127.0.0.1" in status["error"]
    assert not copied.exists() and pool_service.asked == []

    # And the same job on a pool that allows loopback runs and reads the input (the check,
    # not something else, is what failed the first)
    job_id = submit(repo, tenant.id, command=["sh", "-c", f'cat "$E31_INPUT_DIR/m" > {copied}'],
                       inputs={"m": f"{pool_service.url}/secret"})
    allowing = dataclasses.replace(svc, settings=svc.settings.model_copy(
        update={"input_allowed_networks": ("127.0.0.0/8",)}))
    task.run_job(allowing, job_id, publish(repo, job_id))
    assert repo.get_job(None, job_id).state == "succeeded"
    assert copied.read_bytes() == SECRET


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/metrics", "http://[::1]/", "http://localhost/",
    "http://169.254.169.254/latest/meta-data/",
])
def test_the_api_refuses_an_input_whose_url_shows_a_refused_address(
        make_app: MakeApp, repo: Repo, url: str) -> None:
    # Given a tenant of a pool that allows no private network
    _, token = repo.create_tenant("team-a", now=utcnow())
    api = TestClient(make_app())

    # When it submits a job with that input
    answer = api.post("/v1/jobs", json={"command": ["true"], "inputs": {"data": url}},
                      headers=bearer(token))

    # Then the API answers 403 (what the pool lets no tenant use) naming the input and why,
    # and stores nothing
    assert answer.status_code == 403, answer.text
    [error] = answer.json()["errors"]
    assert error["field"] == "inputs.data"
    assert error["reason"].startswith("refused: its host ")
    assert "input_allowed_networks" in error["reason"]
    assert api.get("/v1/jobs", headers=bearer(token)).json()["jobs"] == []


def test_the_api_takes_an_input_of_a_network_the_operator_allows(make_app: MakeApp,
                                                                   repo: Repo) -> None:
    # Given a pool that allows the loopback network
    _, token = repo.create_tenant("team-a", now=utcnow())
    api = TestClient(make_app(input_allowed_networks=("127.0.0.0/8",)))

    # When a tenant submits an input on it, Then it is queued
    answer = api.post("/v1/jobs", json={"command": ["true"],
                                        "inputs": {"data": "http://127.0.0.1:8000/x"}},
                      headers=bearer(token))
    assert answer.status_code == 201, answer.text


def test_an_array_item_with_a_refused_input_is_named_in_the_403(make_app: MakeApp,
                                                                repo: Repo) -> None:
    # Given a tenant that submits an array whose second item reads the metadata service
    _, token = repo.create_tenant("team-a", now=utcnow())
    api = TestClient(make_app())
    items: list[dict[str, Any]] = [
        {"command": ["true"], "inputs": {"d": "https://example.com/data.csv"}},
        {"command": ["true"], "inputs": {"d": "http://169.254.169.254/latest/meta-data/"}}]

    # When it submits the array
    answer = api.post("/v1/arrays", json={"items": items}, headers=bearer(token))

    # Then the API refuses the whole array with 403, naming that item's input
    assert answer.status_code == 403, answer.text
    assert any(e["field"].endswith("inputs.d") and "link-local" in e["reason"]
               for e in answer.json()["errors"]), answer.text


def self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A certificate for the host `name`, signed by its own key: (certificate, key) files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = utcnow()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_an_https_input_connects_to_the_checked_address_but_names_its_host_to_tls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an https server on 127.0.0.1 with a certificate for `localhost` alone, whose CA
    # the worker trusts, recording the name each client asks for (SNI) and its Host header
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path, "localhost")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    server = Server("127.0.0.1")
    sni: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda _sock, name, _ctx: sni.append(name)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    source = f"https://localhost:{server.httpd.server_address[1]}/secret"

    with server:
        # When the worker stages it on a pool that allows the loopback
        staged = stage(source, tmp_path / "a", allowed=("127.0.0.0/8", "::1/128"))

        # Then it connected to an address it resolved and checked, yet TLS was asked for
        # `localhost` and the certificate checked for that name: the host name is kept
        assert staged.read_bytes() == SECRET
        assert sni == ["localhost"] and server.asked == ["/secret"]

        # And on a pool that does not allow the loopback, the same name is refused before TLS
        with pytest.raises(SetupError, match="localhost resolves to"):
            stage(source, tmp_path / "b")
        assert sni == ["localhost"]
