"""Whose a failed environment build is (docs/reliability.md, "Whose failure it is"): uv's own
output, as uv 0.13 prints it for a package index that answers 503 or 429, refuses or resets
the connection, or does not answer in time (the pool's: `setup_transient`), and for a
requirement no index has, a version conflict or an index host name that does not exist (not:
`setup`). The outputs are those uv printed against real local servers."""

from __future__ import annotations

import pytest

from e31_worker.attempt.transient import index_fault

URL = "http://127.0.0.1:18503/simple/nothing-here/"
WHEEL = "http://127.0.0.1:18502/files/tomli_w-1.2.0-py3-none-any.whl"
SENT = f"  cause: Failed to fetch: {URL}\n  cause: error sending request for url ({URL})\n"

POOLS = {
    "503": ("error: Request failed after 3 retries in 7.3s\n"
            f"  cause: Failed to fetch: {URL}\n"
            f"  cause: HTTP status server error (503 Service Unavailable) for url ({URL})\n"),
    "429": ("error: Request failed after 3 retries in 9.8s\n"
            f"  cause: Failed to fetch: {URL}\n"
            f"  cause: HTTP status client error (429 Too Many Requests) for url ({URL})\n"),
    "refused": ("error: Request failed after 3 retries in 9.1s\n" + SENT
                + "  cause: client error (Connect)\n  cause: tcp connect error\n"
                "  cause: Connection refused (os error 111)\n"),
    "reset": ("error: Request failed after 3 retries in 10.6s\n" + SENT
              + "  cause: client error (SendRequest)\n  cause: connection error\n"
              "  cause: Connection reset by peer (os error 104)\n"),
    "timeout": ("error: Request failed after 3 retries in 12.6s\n" + SENT
                + "  cause: operation timed out\n"),
    "a wheel's 502": (
        "error: Request failed after 3 retries in 6.7s\n"
        f"  cause: Failed to fetch: {WHEEL}\n"
        f"  cause: HTTP status server error (502 Bad Gateway) for url ({WHEEL})\n"),
}
USERS = {
    "not there": ("error: No solution found when resolving dependencies\n"
                  "  cause: Because nothing-here was not found in the package registry and you "
                  "require nothing-here, we can conclude that your requirements are "
                  "unsatisfiable.\n"),
    "conflict": ("error: No solution found when resolving dependencies\n"
                 "  cause: Because you require numpy==1.0 and numpy==2.0.0, we can conclude "
                 "that your requirements are unsatisfiable.\n"),
    "no such host": ("error: Request failed after 3 retries in 8.1s\n" + SENT
                     + "  cause: client error (Connect)\n  cause: dns error\n"
                     "  cause: error resolving DNS\n"
                     "  cause: failed to lookup address information: Name or service not "
                     "known\n"),
    "a name that says so, before the error": (
        "Using Python 3.11.7 environment at: env\n"
        "Resolved 1 package: connection-refused-timed-out==1.0\n"
        "error: No solution found when resolving dependencies\n"
        "  cause: Because connection-refused-timed-out==1.0 depends on numpy==1.0 and you "
        "require numpy==2.0.0, we can conclude that your requirements are unsatisfiable.\n"),
    "no error line": "Connection refused (os error 111)\n",
}


@pytest.mark.parametrize("output", POOLS.values(), ids=POOLS.keys())
def test_an_index_that_failed_in_a_way_that_may_pass_is_the_pools(output: str) -> None:
    assert index_fault(output)


@pytest.mark.parametrize("output", USERS.values(), ids=USERS.keys())
def test_a_requirement_no_index_has_or_a_conflict_is_not(output: str) -> None:
    assert not index_fault(output)
