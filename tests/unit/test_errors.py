"""The one error hierarchy: a root, "Raised when…" docstrings that are the default messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from e31.core import errors
from e31.core.errors import ClientError, E31Error, JobFailed, SpecError


def all_error_classes() -> list[type[E31Error]]:
    found: list[type[E31Error]] = []
    todo: list[type[E31Error]] = [E31Error]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted({c for c in found if c.__module__ == errors.__name__}, key=lambda c: c.__name__)


ALL = all_error_classes()
# These build their message from the data they carry (the spec's errors, the job's status).
NO_ARG = [c for c in ALL if c not in (SpecError, JobFailed, errors.RemoteError)]


def test_every_exception_class_in_errors_descends_from_the_root() -> None:
    # Given every exception class the errors module defines
    defined = [v for v in vars(errors).values()
               if isinstance(v, type) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__]

    # Then each is an E31Error, so callers can catch one root
    assert defined and all(issubclass(c, E31Error) for c in defined)
    assert set(defined) == set(ALL)


SOURCES = [p for root in ("platform/e31", "workers/e31_worker")
           for p in (Path(__file__).parents[2] / root).rglob("*.py") if p.name != "errors.py"]


@pytest.mark.parametrize("cls", [c for c in ALL if c is not E31Error], ids=lambda c: c.__name__)
def test_every_error_class_is_raised_somewhere(cls: type[E31Error]) -> None:
    # Given the package's sources outside the errors module
    raised = re.compile(rf"\braise {cls.__name__}\b")

    # Then some code raises the class: none is kept for a use that never came
    assert any(raised.search(p.read_text()) for p in SOURCES), cls


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_class_has_a_raised_when_docstring(cls: type[E31Error]) -> None:
    doc = cls.__dict__.get("__doc__") or ""
    assert doc.strip().startswith("Raised when"), cls


@pytest.mark.parametrize("cls", NO_ARG, ids=lambda c: c.__name__)
def test_an_error_raised_without_a_message_says_its_docstrings_first_line(
        cls: type[E31Error]) -> None:
    # Given an error class
    first_line = (cls.__doc__ or "").strip().splitlines()[0]

    # When it is raised without a message
    exc = cls()

    # Then its message is the docstring's first line
    assert str(exc) == first_line
    assert exc.message == first_line


def test_an_explicit_message_replaces_the_docstring() -> None:
    exc = errors.NotFound("no job j-1")
    assert exc.message == "no job j-1"
    assert isinstance(exc, errors.StoreError)


def test_a_spec_error_joins_field_and_reason_pairs() -> None:
    # Given two field errors
    exc = SpecError([{"field": "priority", "reason": "must be 0..9"},
                     {"field": "resources.gpus", "reason": "at most 8"}])

    # Then the message lists them as "field: reason" and keeps the entries
    assert exc.message == "priority: must be 0..9; resources.gpus: at most 8"
    assert exc.errors[1] == {"field": "resources.gpus", "reason": "at most 8"}


def test_spec_error_one_builds_a_single_entry() -> None:
    exc = SpecError.one("spec", "must be a mapping of fields")
    assert exc.errors == [{"field": "spec", "reason": "must be a mapping of fields"}]
    assert exc.message == "spec: must be a mapping of fields"


def test_a_spec_error_without_entries_falls_back_to_its_docstring() -> None:
    assert SpecError([]).message == "Raised when a job spec is invalid."


def test_a_client_error_keeps_the_http_status_and_body() -> None:
    exc = ClientError("bad", status_code=422, body={"detail": []})
    assert (exc.message, exc.status_code, exc.body) == ("bad", 422, {"detail": []})


def test_job_failed_names_the_job_its_state_and_reason() -> None:
    # Given the final status of a failed job
    exc = JobFailed({"id": "j-1", "state": "failed", "reason": "timeout", "error": "ran 3600 s"})

    # Then the error names them and exposes the reason
    assert exc.reason == "timeout"
    assert exc.message == "job j-1 failed: timeout: ran 3600 s"
    assert isinstance(exc, ClientError)
