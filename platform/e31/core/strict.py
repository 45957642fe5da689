"""The strict model every part of a job spec is, and its whole-number fields.

Types are strict: `true` is no number and `"9"` no integer (a whole number may stand for a
float, and a float without a fraction, `2.0`, for an integer: JSON Schema counts it as one, and
the API's OpenAPI schema is JSON Schema); numbers are finite; an unknown field is refused.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

STORED = "stored"             # validation context of a spec read back from the store


def _whole(value: Any) -> Any:
    """A float without a fraction (`2.0`) as the integer it is; anything else as it came."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Whole = Annotated[int, BeforeValidator(_whole)]
"""An integer field: an int, or a float without a fraction; never a bool or a string."""
WholeOrNone = Annotated[int | None, BeforeValidator(_whole)]
"""`Whole` or None. (`Whole | None` would write a field's bounds into its JSON Schema as
pydantic's `gt`/`le` rather than `exclusiveMinimum`/`maximum`.)"""


class Strict(BaseModel):
    """A spec part: frozen, strict, finite, no unknown field."""

    # strict: no `true` for a number, no "9" for an int; finite numbers only.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
