"""An `http(s)://` input, fetched only from addresses the pool allows (e31.core.addresses).

The worker fetches an input from its own network, whatever the job's: so the address it
connects to must be public or inside `input_allowed_networks`, or a tenant could stage the
pool's own services (`http://127.0.0.1:<flower>/metrics`) or the cloud's metadata into its job.
The check sits where the connection is made, in an httpcore network backend: the host name is
resolved once, every address it resolves to is checked, and the socket is opened to one of
those checked addresses (no second lookup, so no DNS rebinding between the check and the
connection); TLS and the `Host` header still name the URL's host. Redirects are followed
here, one hop at a time (at most `MAX_REDIRECTS`), so each hop's connection is checked too.
The fetch goes straight to the server, never through a proxy of the worker's environment
(a proxy would connect where this check cannot see), and reads no `.netrc` (a tenant's URL
gets none of the worker's credentials); an operator's CA bundle (`SSL_CERT_FILE`,
`SSL_CERT_DIR`) still counts.
"""

from __future__ import annotations

import socket
import typing
from pathlib import Path

import httpcore
import httpx

from e31.core.addresses import ALLOW_HINT, refusal
from e31.core.errors import SetupError

HTTP_TIMEOUT_S = 60.0     # between two reads of an http(s) input, not for the whole of it
MAX_REDIRECTS = 10        # hops one input may take; httpx's own default is 20
COPY_CHUNK_BYTES = 1024 * 1024


class CheckedBackend(httpcore.NetworkBackend):
    """httpcore's own network backend, but a TCP connection goes only to an address that
    `refusal` allows for `allowed`; a host that resolves to any other is refused whole."""

    def __init__(self, allowed: tuple[str, ...],
                 inner: httpcore.NetworkBackend | None = None) -> None:
        self._allowed = allowed
        self._inner = inner or httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
                    ) -> httpcore.NetworkStream:
        addresses = self._checked(host, port)
        failed: httpcore.ConnectError | None = None
        for address in addresses:
            try:
                return self._inner.connect_tcp(address, port, timeout, local_address,
                                               socket_options)
            except httpcore.ConnectError as exc:
                failed = exc
        assert failed is not None   # `_checked` returns at least one address
        raise failed

    def _checked(self, host: str, port: int) -> list[str]:
        """Every address `host` resolves to, each allowed; `SetupError` naming the first that
        is not."""
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
        addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
        for address in addresses:
            why = refusal(address, self._allowed)
            if why is not None:
                shown = host if host == address else f"{host} resolves to {address}, which"
                raise SetupError(f"{shown} is {why}; {ALLOW_HINT}")
        return addresses

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
                            ) -> httpcore.NetworkStream:
        raise SetupError("an http(s) input never reads a unix socket")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class CheckedTransport(httpx.HTTPTransport):
    """httpx's transport over a `CheckedBackend`. httpx names no network backend, so the
    connection pool it builds (`_pool`, since httpx 0.18) is built again here, as httpx
    builds it without a proxy, with that backend."""

    def __init__(self, allowed: tuple[str, ...]) -> None:
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=True),   # the CA bundle only
            network_backend=CheckedBackend(allowed))


def download(url: str, target: Path, allowed: tuple[str, ...]) -> None:
    """GET `url` into `target` (created), following at most `MAX_REDIRECTS` redirects, each
    connection to an allowed address only: `SetupError` naming the URL and the refused
    address otherwise."""
    with httpx.Client(transport=CheckedTransport(allowed), trust_env=False,
                      timeout=HTTP_TIMEOUT_S) as client:
        request = client.build_request("GET", url)
        for _ in range(MAX_REDIRECTS + 1):
            try:
                response = client.send(request, stream=True, follow_redirects=False)
            except SetupError as exc:
                raise SetupError(f"refused {_hops(url, request)}: {exc.message}") from None
            try:
                if response.next_request is None:
                    response.raise_for_status()
                    _write(response, target)
                    return
                request = response.next_request
            finally:
                response.close()
    raise SetupError(f"{url} redirects more than {MAX_REDIRECTS} times")


def _hops(url: str, request: httpx.Request) -> str:
    """The URL refused, and the input's own when a redirect led there."""
    now = str(request.url)
    return url if now == str(httpx.URL(url)) else f"{now} (redirected from {url})"


def _write(response: httpx.Response, target: Path) -> None:
    with open(target, "xb") as out:
        for chunk in response.iter_bytes(COPY_CHUNK_BYTES):
            out.write(chunk)
