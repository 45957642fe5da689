"""How `JobHandle.wait()` and `watch()` ask for a job's status: a long poll where the API holds
the answer, a back-off from 50 ms where it does not, never a fixed half second. A fake API
(httpx's MockTransport) and a fake clock: the test asserts the requests and the sleeps asked
for, not how long anything took."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import httpx
import pytest

from e31 import Client, JobHandle
from e31.client import handles
from e31.core.errors import JobTimeout

JOB = "j-00000000000000000000"


class FakeTime:
    """`time` as handles.py uses it: a clock that moves only when slept on or held."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(round(s, 6))
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(handles, "time", fake)
    return fake


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> Client:
    client = Client("http://e31.invalid", "token")
    client._http = httpx.Client(base_url="http://e31.invalid",
                                transport=httpx.MockTransport(handler))
    return client


def test_wait_long_polls_and_a_job_that_ends_within_one_poll_costs_one_request(
        clock: FakeTime) -> None:
    # Given an API that holds a long poll until the job ends, 3.2 s from now
    ends_at = clock.now + 3.2
    asked: list[str | None] = []

    def api(request: httpx.Request) -> httpx.Response:
        wait_s = request.url.params.get("wait_s")
        asked.append(wait_s)
        clock.now = min(clock.now + float(wait_s or 0), max(clock.now, ends_at))
        return httpx.Response(200, json={"id": JOB, "state": "succeeded" if clock.now >= ends_at
                                         else "running"})

    # When its owner waits
    status = JobHandle(_client(api), JOB).wait()

    # Then one request asked the API to hold it, and the client never slept
    assert status["state"] == "succeeded"
    assert asked == [str(handles.WAIT_LONG_POLL_S)] and clock.sleeps == []


def test_wait_on_an_api_that_answers_at_once_backs_off_from_50_ms_not_half_a_second(
        clock: FakeTime) -> None:
    # Given an API from before the long poll: it answers at once, whatever wait_s says
    states = ["queued"] * 3 + ["running"] * 6 + ["succeeded"]
    client = _client(lambda _: httpx.Response(200, json={"id": JOB, "state": states.pop(0)}))

    # When its owner waits
    status = JobHandle(client, JOB).wait()

    # Then the waits between polls start at 50 ms and grow 1.5 times up to 1 s: the job is
    # seen ended within one such wait of its end, and no wait is a fixed 0.5 s
    assert status["state"] == "succeeded" and states == []
    assert clock.sleeps == [0.05, 0.075, 0.1125, 0.16875, 0.253125, 0.379688, 0.569531,
                            0.854297, 1.0]


def test_wait_asks_no_longer_than_its_timeout_and_then_raises(clock: FakeTime) -> None:
    # Given a job that never ends, on an API that holds each long poll
    asked: list[str | None] = []

    def api(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params.get("wait_s"))
        clock.now += float(request.url.params.get("wait_s") or 0)
        return httpx.Response(200, json={"id": JOB, "state": "running"})

    # When its owner waits 21 s
    with pytest.raises(JobTimeout):
        JobHandle(_client(api), JOB).wait(timeout=21)

    # Then the polls together hold for what the timeout leaves, no more
    assert asked == ["8", "8", "5"] and clock.sleeps == []


def test_watch_yields_each_status_with_back_off_or_the_interval_it_is_given(
        clock: FakeTime) -> None:
    def api_of(states: list[str]) -> Client:
        return _client(lambda _: httpx.Response(200, json={"id": JOB, "state": states.pop(0)}))

    seen = [s["state"] for s in JobHandle(api_of(["queued", "running", "running", "failed"]),
                                          JOB).watch()]
    assert seen == ["queued", "running", "running", "failed"]
    assert clock.sleeps == [0.05, 0.075, 0.1125]

    clock.sleeps.clear()
    list(JobHandle(api_of(["queued", "running", "succeeded"]), JOB).watch(poll_s=2.0))
    assert clock.sleeps == [2.0, 2.0]


def test_poll_delays_grow_to_their_cap() -> None:
    assert list(itertools.islice(handles.poll_delays(0.1, 2.0, 0.5), 5)) == [0.1, 0.2, 0.4,
                                                                              0.5, 0.5]
