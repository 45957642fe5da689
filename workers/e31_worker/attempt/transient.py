"""Which failures of an attempt's setup are the pool's and may pass, from an exception
(`is_transient`) or from uv's output when the package index failed (`index_fault`): a
server's 5xx or 429, a connection reset, refused or timed out, a name server that did not
answer. Such a failure
ends the attempt with reason `setup_transient` (the pool's: retried on its account, up to its
`infra_retries`); any other stays `setup` (the user's and final: a 404, a 403, a 400, a host
name that does not exist, an address the pool refuses). docs/reliability.md, "Whose failure it
is", has the table.

The causes are read along the exception's chain: httpx wraps httpcore's errors, which wrap
the socket's, and s3fs turns botocore's answers into `OSError`s (503 and `SlowDown` into
`EBUSY`, 500 into `EREMOTEIO`, `RequestTimeout` into `TimeoutError`) with the answer as cause.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
# OSError numbers of a fault that may pass: s3fs's 503 and 500 (EBUSY, EREMOTEIO), and the
# network's (a connection reset, refused or aborted; a host or network out of reach; a timeout).
TRANSIENT_ERRNOS = frozenset({
    errno.EBUSY, errno.EREMOTEIO, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
    errno.EPIPE, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN})
# botocore's errors of the connection itself (no answer came): by name, as botocore is
# installed only with s3fs.
BOTOCORE_CONNECTION_ERRORS = frozenset({"ConnectionError", "HTTPClientError"})
# What uv says of an index that failed in a way that may pass (docs/reliability.md, "Whose
# failure it is"): its causes, as uv 0.13 prints them ("HTTP status server error (503 Service
# Unavailable) for url ...", "Connection refused (os error 111)", "operation timed out").
_INDEX_FAULT = re.compile(
    r"HTTP status server error \(5\d\d |\(429 Too Many Requests\)|Connection refused"
    r"|Connection reset|connection closed before|timed out"
    r"|Temporary failure in name resolution|Network is unreachable|No route to host")
CHAIN_MAX = 16    # causes followed, against a cycle of __context__


def is_transient(exc: BaseException) -> bool:
    """Whether `exc`, raised while a setup fetched something, is a fault that may pass."""
    chain = list(_chain(exc))
    for e in chain:   # a name lookup decides alone: a name that does not exist is the user's
        if isinstance(e, socket.gaierror):
            return e.errno == socket.EAI_AGAIN
    return any(_transient_one(e) for e in chain)


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, httpx.HTTPStatusError):
        return e.response.status_code in TRANSIENT_STATUS
    if isinstance(e, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
        return True
    if isinstance(e, ConnectionError | TimeoutError):
        return True
    if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
        return True
    if type(e).__module__.startswith("botocore") and \
            any(c.__name__ in BOTOCORE_CONNECTION_ERRORS for c in type(e).__mro__):
        return True
    return _status(getattr(e, "response", None)) in TRANSIENT_STATUS


def _status(response: Any) -> int | None:
    """The HTTP status of a botocore `ClientError`'s response (a dict), if it has one."""
    if not isinstance(response, dict):
        return None
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < CHAIN_MAX:
        seen.add(id(e))
        yield e
        # `raise ... from None` said the context is not the cause: it ends the chain.
        e = e.__cause__ if e.__cause__ is not None else (
            None if e.__suppress_context__ else e.__context__)


def index_fault(output: str) -> bool:
    """Whether uv failed because the package index (the operator's, never the job's) failed in
    a way that may pass: it answered 5xx or 429, or the connection to it was refused, reset or
    timed out, or the name server did not answer. uv retries those itself (`Request failed
    after 3 retries`) before it gives up. A requirement no index has, a version conflict or a
    host name that does not exist are not (the user's `setup`, or a setting to mend). Read
    from uv's error on, not from what it printed before (a package's name, a resolution)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("error:", "×"))), None)
    return start is not None and _INDEX_FAULT.search("\n".join(lines[start:])) is not None
