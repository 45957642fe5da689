"""What a name, a variable and an argument may hold: the text rules the spec's parts share.

A name (a job's, an array's) is printable text: a newline in one would start a forged line in
a log. A variable's name is an environment variable's (ASCII letters, digits, `_`), and the
worker sets some itself (`reserved_env`). An argument or a value a process is given holds no
NUL and no lone surrogate (`no_nul`), which no process could take. Names are ASCII here; the
API's OpenAPI schema (e31.api.schema) states these same patterns.
"""

from __future__ import annotations

import re
import unicodedata

NAME_MAX = 200
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRET_NAME_MAX = 100         # a secret's name (the store's secrets.name)
# Not text a name may hold: control characters (newline, escape, DEL, C1), lone surrogates,
# line and paragraph separators. A newline in a name would start a forged line in a log.
_NOT_TEXT = frozenset({"Cc", "Cs", "Zl", "Zp"})


def no_nul(value: str, what: str) -> str:
    """`value` if a process can take it as an argument or a variable: no NUL, and no lone
    surrogate (which has no bytes to pass)."""
    if "\x00" in value:
        raise ValueError(f"{what} must not contain a NUL character")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError(f"{what} must be text (a lone surrogate is not)") from None
    return value


def _not_text(value: str) -> str | None:
    """The first character of `value` that a name may not hold, or None."""
    if value.isprintable():          # the fast path: most names are plain text
        return None
    return next((c for c in value if unicodedata.category(c) in _NOT_TEXT), None)


def check_name(value: str, what: str = "the name") -> str:
    """`value` if it is a name: printable text, no control character (`ValueError` naming it)."""
    bad = _not_text(value)
    if bad is not None:
        raise ValueError(f"{what} must not contain a control character "
                         f"(found {bad.encode('unicode_escape', 'backslashreplace').decode()})")
    return value


def printable(text: str) -> str:
    """`text` with each character a name may not hold written as its escape (`\\n`): what a
    log line or a task label carries of a name, so a name stored before names were checked
    cannot start a line of its own."""
    if _not_text(text) is None:
        return text
    return "".join(c.encode("unicode_escape", "backslashreplace").decode()
                   if unicodedata.category(c) in _NOT_TEXT else c for c in text)


def reserved_env(name: str) -> bool:
    """Whether the worker sets the variable `name` itself (so a spec's env or secrets may not)."""
    return name.startswith("E31_") or name == "CUDA_VISIBLE_DEVICES"
