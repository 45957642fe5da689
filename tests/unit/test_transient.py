"""Which failures of a setup's fetch are the pool's and may pass (e31_worker.attempt.transient),
on the exceptions the real libraries raise: httpx's, the socket's, botocore's and s3fs's
translations of them."""

from __future__ import annotations

import errno
import socket

import botocore.exceptions as boto
import httpx
import pytest
import s3fs.errors

from e31_worker.attempt.transient import is_transient


def http_status(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://inputs.example/data")
    response = httpx.Response(code, request=request)
    try:
        response.raise_for_status()
    except httpx.HTTPStatusError as exc:
        return exc
    raise AssertionError(f"{code} raised nothing")


def s3_error(code: str, status: int) -> OSError:
    """What s3fs raises for an S3 answer: botocore's ClientError, translated."""
    error = boto.ClientError({"Error": {"Code": code, "Message": code},
                              "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
    translated = s3fs.errors.translate_boto_error(error)
    assert isinstance(translated, OSError)
    return translated


def raised_from(exc: BaseException, cause: BaseException) -> BaseException:
    try:
        raise exc from cause
    except BaseException as caught:  # noqa: BLE001 - any, to return it chained
        return caught


@pytest.mark.parametrize("code", [429, 500, 502, 503, 504])
def test_a_server_that_may_recover_is_transient(code: int) -> None:
    assert is_transient(http_status(code))


@pytest.mark.parametrize("code", [400, 401, 403, 404, 410, 501])
def test_an_answer_about_the_request_is_not(code: int) -> None:
    assert not is_transient(http_status(code))


@pytest.mark.parametrize("exc", [
    httpx.ConnectError("[Errno 111] Connection refused"), httpx.ReadTimeout("timed out"),
    httpx.RemoteProtocolError("Server disconnected without sending a response."),
    ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("timed out"),
    OSError(errno.EHOSTUNREACH, "No route to host"),
], ids=lambda e: type(e).__name__)
def test_a_connection_that_failed_is_transient(exc: BaseException) -> None:
    assert is_transient(exc)


def test_a_name_decides_by_its_lookup_not_by_the_connection_error_around_it() -> None:
    # Given httpx's ConnectError around the resolver's answer (as CheckedBackend raises it)
    gone = raised_from(httpx.ConnectError("cannot resolve"),
                       socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    busy = raised_from(httpx.ConnectError("cannot resolve"),
                       socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    # Then a name that does not exist is the user's; a name server that did not answer ours
    assert not is_transient(gone)
    assert is_transient(busy)


@pytest.mark.parametrize(("code", "status", "transient"), [
    ("SlowDown", 503, True), ("ServiceUnavailable", 503, True), ("InternalError", 500, True),
    ("RequestTimeout", 400, True), ("Throttling", 429, True),
    ("NoSuchKey", 404, False), ("AccessDenied", 403, False), ("InvalidRequest", 400, False),
])
def test_s3s_answers_as_s3fs_raises_them(code: str, status: int, transient: bool) -> None:
    assert is_transient(s3_error(code, status)) is transient


def test_botocores_connection_errors_are_transient() -> None:
    assert is_transient(boto.EndpointConnectionError(endpoint_url="http://s3.example"))
    assert is_transient(boto.ReadTimeoutError(endpoint_url="http://s3.example"))
    assert not is_transient(boto.NoCredentialsError())


@pytest.mark.parametrize("exc", [
    FileNotFoundError(errno.ENOENT, "No such file"), PermissionError(errno.EACCES, "denied"),
    ValueError("not a URL"), IsADirectoryError(errno.EISDIR, "is a directory"),
], ids=lambda e: type(e).__name__)
def test_what_the_user_named_wrongly_is_not(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_a_context_said_not_to_be_the_cause_is_not_read() -> None:
    # Given an error raised `from None` while a reset connection was being handled
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        except ConnectionResetError:
            raise ValueError("not a bundle") from None
    except ValueError as exc:
        # Then the reset is not its cause
        assert not is_transient(exc)
