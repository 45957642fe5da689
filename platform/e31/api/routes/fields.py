"""The typed request fields that the tokens and admin routes share: names, whole numbers and
ISO 8601 times, each stated so that the OpenAPI document says exactly what is taken.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Path
from pydantic import BeforeValidator, Field

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="letters, digits, '.', '_', '-'")]
TenantName = Annotated[str, Path(pattern=NAME_PATTERN)]


def _whole(value: Any) -> Any:
    """JSON Schema's integer: 2.0 is 2 (strict models would refuse it); 2.5 and "2" stay
    refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


WHOLE = BeforeValidator(_whole)
"""Placed after the `Field(...)` of an integer in a strict model (`Annotated[int, Field(ge=1),
WHOLE]`), so the bounds stay in the document."""


def _iso_time(value: Any) -> Any:
    """A time in a query is ISO 8601 (`2026-12-01T00:00:00Z`); pydantic would also take a
    number of seconds since 1970 (`?since=0.5`), which the document does not offer."""
    if isinstance(value, str) and not _ISO_DATE.match(value):
        raise ValueError("must be an ISO 8601 time, e.g. 2026-12-01T00:00:00Z")
    return value


_ISO_DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}")
ISO_TIME = BeforeValidator(_iso_time)
