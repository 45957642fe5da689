"""Schemathesis hooks for the API fuzz test (`SCHEMATHESIS_HOOKS`, set by `schemathesis_run`):
the verdicts a check cannot reach from the document alone, each dropped narrowly, by the
operation's check and what the answer or the case says, never by status alone.

- **Rules JSON Schema cannot state** (`UNSTATED`). A token's `expires_at` must fall in the
  future and within ten years: the document says the instant's grammar (`format: date-time`)
  but not the server's now. A job's secret must not also be in its `env`: no keyword relates an
  array's items to an object's keys. A schema-valid body refused 422 naming such a rule is not
  valid data refused; each rule has its own test (tests/integration/test_cli_token_expiry.py,
  tests/unit/test_spec.py).
- **A multipart file part whose type was mutated.** A part carries bytes and never a type: a
  `file` turned into a number arrives as the bytes of that number, which no server can tell
  from a file holding them. Other mutations of the upload (no file, no purpose, a purpose not
  `batch`) are still required to be refused.
"""

from __future__ import annotations

import re
from typing import Any

import schemathesis
from schemathesis.generation.meta import negated_parameters

from e31.core.spec import SECRET_IN_ENV
from e31.store.tokens import EXPIRY_PAST, EXPIRY_TOO_FAR

# (field, reason) of each 422 for a rule the document cannot state: see the module's docstring
UNSTATED = (
    (re.compile(r"expires_at"),
     re.compile("|".join(map(re.escape, (EXPIRY_PAST, EXPIRY_TOO_FAR))))),
    (re.compile(r"(.*\.)?secrets\[\d+\]"), re.compile(rf"\w+ {re.escape(SECRET_IN_ENV)}")),
)


def unstated_rule_refused(failure: Any, response: Any) -> bool:
    """Whether `failure` is a schema-valid body refused 422 naming a rule in `UNSTATED`."""
    if failure.code != "ST202" or response.status_code != 422:
        return False
    try:
        errors = response.json().get("errors") or []
    except ValueError:
        return False
    return any(field.fullmatch(str(e.get("field"))) and reason.fullmatch(str(e.get("reason")))
               for e in errors for field, reason in UNSTATED)


def file_part_retyped(failure: Any, case: Any) -> bool:
    """Whether `failure` is POST /v1/files taking an upload whose only mutation is the type of
    its `file` part."""
    if failure.code != "ST201" or case.operation.label != "POST /v1/files":
        return False
    data = case.meta.phase.data
    mutations = getattr(data, "mutations", ())
    return (bool(mutations) and {name for name, _ in negated_parameters(case.meta)} <= {"file"}
            and all(m.keywords == ("type",) and m.schema_pointer == "/properties/file"
                    for m in mutations))


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """Keep every failure but those the module names."""
    return not (unstated_rule_refused(failure, response) or file_part_retyped(failure, case))
