"""`JobHandle.value` and `result()` of a function job over a fake API (httpx's MockTransport):
the value from `result.pkl`, the function's own exception with its remote traceback, and a
clear error when the value was not stored. No server runs."""

from __future__ import annotations

import cloudpickle
import httpx
import pytest

from e31 import Client, JobHandle, RemoteError
from e31.core.errors import FunctionError
from e31.core.functioncalls import preview

JOB = "j-00000000000000000000"
TRACEBACK = 'Traceback (most recent call last):\n  File "main.py", line 3, in f\nKeyError: 7\n'


def _handle(state: str, files: dict[str, bytes], result: object = None) -> JobHandle:
    status = {"id": JOB, "state": state, "result": result, "reason": "error",
              "error": "KeyError: 7"}

    def answer(request: httpx.Request) -> httpx.Response:
        name = request.url.path.rpartition("/outputs/")[2]
        if "/outputs/" not in request.url.path:
            return httpx.Response(200, json=status)
        if name in files:
            return httpx.Response(200, content=files[name])
        return httpx.Response(404, json={"message": "no such output"})

    client = Client("http://e31.invalid", "token")
    client._http = httpx.Client(base_url="http://e31.invalid",
                                transport=httpx.MockTransport(answer))
    return JobHandle(client, JOB)


def test_a_function_jobs_result_is_its_python_value() -> None:
    value = {"scores": [0.5, 0.25]}
    data = cloudpickle.dumps(value)
    job = _handle("succeeded", {"result.pkl": data}, preview(value, len(data)))
    assert job.result() == value


def test_a_failed_function_job_raises_its_own_exception_with_the_remote_traceback() -> None:
    job = _handle("failed", {"exception.pkl": cloudpickle.dumps(KeyError(7)),
                             "traceback.txt": TRACEBACK.encode()})
    with pytest.raises(KeyError) as raised:
        job.value()
    assert raised.value.__notes__ == [f"remote traceback (job {JOB}):\n{TRACEBACK.rstrip()}"]


def test_an_exception_that_cannot_travel_is_a_remote_error_holding_the_traceback() -> None:
    job = _handle("failed", {"exception.pkl": b"not a pickle", "traceback.txt":
                             TRACEBACK.encode()})
    with pytest.raises(RemoteError, match="KeyError: 7") as raised:
        job.value()
    assert raised.value.traceback_text == TRACEBACK and "remote traceback" in str(raised.value)


def test_a_value_the_pool_did_not_store_is_a_clear_error_naming_the_limit() -> None:
    job = _handle("succeeded", {}, preview(b"x", 30 * 1024 ** 3))
    with pytest.raises(FunctionError, match="job_outputs_max_bytes"):
        job.result()
