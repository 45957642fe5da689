"""The lines of a batch's input file, checked as OpenAI checks them before anything runs.

Each line is one request, `{"custom_id", "method": "POST", "url": <the batch's endpoint>,
"body": {"model", <the endpoint's input field>, ...}}`. A file that is not JSONL, a line without
a `custom_id`, a `custom_id` seen before, a `url` that is not the batch's endpoint, a body
without `model` or its input: the batch fails at validation, with OpenAI's `errors` object
naming each line (`Checked.errors`), and nothing runs. Which models exist is not decided here:
a line naming a model the pool does not know fails alone, when the batch is sharded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from e31.core.batches import INPUT_FIELD

ERRORS_SHOWN = 50          # lines named in one `errors` object; the count says how many more
CUSTOM_ID_MAX = 512        # characters of one custom_id


@dataclass(frozen=True)
class Request:
    """One good line: its number (1-based), its custom_id, the model it names, and the line
    itself as it came (re-encoded once, compact)."""

    line: int
    custom_id: str
    model: str
    text: str


@dataclass
class Checked:
    """What the check of a file found: the good requests, and the errors of the bad lines in
    OpenAI's shape (`{"code", "message", "param", "line"}`)."""

    requests: list[Request] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0

    def refuse(self, line: int | None, code: str, message: str,
               param: str | None = None) -> None:
        self.bad_lines += 1
        if len(self.errors) < ERRORS_SHOWN:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})

    def errors_object(self) -> dict[str, Any] | None:
        """OpenAI's `errors` of a batch that failed validation; None when none."""
        if not self.bad_lines:
            return None
        data = list(self.errors)
        if self.bad_lines > len(data):
            data.append({"code": "too_many_errors", "line": None, "param": None,
                         "message": f"{self.bad_lines} lines are invalid; the first "
                                    f"{len(self.errors)} are named"})
        return {"object": "list", "data": data}


def check_lines(lines: Iterable[bytes], *, endpoint: str, max_requests: int) -> Checked:
    """Check every line of an input file for a batch of `endpoint` (blank lines are skipped)."""
    checked = Checked()
    seen: set[str] = set()
    count = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        count += 1
        if count > max_requests:
            checked.refuse(number, "too_many_requests",
                           f"a batch holds {max_requests} requests at most "
                           "(the setting batch_max_requests)")
            break
        request = _check_line(checked, number, raw, endpoint, seen)
        if request is not None:
            checked.requests.append(request)
    if count == 0:
        checked.refuse(None, "empty_file", "the input file holds no request")
    return checked


def _check_line(checked: Checked, number: int, raw: bytes, endpoint: str,
                seen: set[str]) -> Request | None:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        checked.refuse(number, "invalid_json_line",
                       f"line {number} is not a JSON object: {exc}")
        return None
    if not isinstance(obj, dict):
        checked.refuse(number, "invalid_json_line", f"line {number} is not a JSON object")
        return None
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        checked.refuse(number, "missing_required_parameter",
                       f"line {number} has no custom_id (a non-empty string)", "custom_id")
        return None
    if len(custom_id) > CUSTOM_ID_MAX:
        checked.refuse(number, "invalid_value",
                       f"line {number}: custom_id is longer than {CUSTOM_ID_MAX} characters",
                       "custom_id")
        return None
    if custom_id in seen:
        checked.refuse(number, "duplicate_custom_id",
                       f"line {number}: custom_id {custom_id!r} is on an earlier line too; "
                       "each request needs its own", "custom_id")
        return None
    seen.add(custom_id)
    problem = _request_problem(obj, endpoint)
    if problem is not None:
        code, param, why = problem
        checked.refuse(number, code, f"line {number}: {why}", param)
        return None
    body = obj["body"]
    return Request(line=number, custom_id=custom_id, model=body["model"],
                   text=json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


def _request_problem(obj: dict[str, Any], endpoint: str) -> tuple[str, str, str] | None:
    """(code, param, why) of the first thing wrong with a line's request, or None."""
    method = obj.get("method", "POST")
    if method != "POST":
        return "invalid_value", "method", f"method is {method!r}; a batch's requests are POST"
    url = obj.get("url")
    if url != endpoint:
        return ("mismatched_endpoint", "url",
                f"url {url!r} is not the batch's endpoint {endpoint}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return "missing_required_parameter", "body", "body is missing or not an object"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "missing_required_parameter", "body.model", "body.model is missing"
    need = INPUT_FIELD[endpoint]
    if body.get(need) in (None, "", []):
        return ("missing_required_parameter", f"body.{need}",
                f"body.{need} is missing; {endpoint} needs it")
    return None
