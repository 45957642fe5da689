"""What a job's requirements may say: packages, and nothing else (docs/jobs.md, `python:`).

A job's `python.pip` items and the lines of its `python.requirements` file are handed to uv,
which would otherwise take much more than a package name from them: an option (`-r FILE`,
`-c FILE`, `-e PATH`, `--index-url URL`, `--find-links DIR`, …), a path, a `file:` URL, a
direct or VCS URL (`pkg @ https://…`, `git+https://…`), a `${VARIABLE}` to expand. Each of
those reads something the pool chose not to give the job: a file of the host (`-r
/proc/<pid>/environ` once quoted a worker's Redis password back in uv's parse error), a
variable of the build's environment, or an index the operator did not choose. So a line is
taken only when it is one requirement as PEP 508 spells it, without a URL: a name, extras,
version specifiers and an environment marker. Comments and blank lines are fine; a line
continuation (`\\` at the end) is refused rather than joined, so that no reading of the file
other than this one line-by-line reading can see a different line.

Pure: no I/O. The API checks at submit (the spec's items, and the file read from the job's
bundle), and the worker checks again before it builds (a spec stored before this check).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement

REQUIREMENTS_MAX_BYTES = 1024 * 1024   # a requirements file larger than this is not one
SHOWN_CHARS = 120                      # of an offending line, quoted back in a refusal
VCS_PREFIXES = ("git+", "hg+", "svn+", "bzr+")
# File names pip and uv take as a path to an archive or a wheel, not as a package's name.
ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz",
                    ".tar.xz", ".txz", ".tar.lz", ".tar.zst", ".egg")
_COMMENT = re.compile(r"(^|\s)#.*$")   # as pip and uv read a comment: '#' at the start or
#                                        after white space (a URL's '#fragment' is none)
_WHY_ONLY = ("a job's requirements name packages only (name, extras, version, marker); "
             "the package index is the pool's")


@dataclass(frozen=True)
class Refusal:
    """One refused line of a requirements file: its number (from 1), the line, and why."""

    line: int
    text: str
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {_shown(self.text)} {self.reason}"


def requirement_problem(item: str) -> str | None:
    """Why `item`, one requirement as a `python.pip` item gives it, is not a plain requirement
    (a sentence that starts with the item's kind), or None when it is one."""
    if "\n" in item or "\r" in item:
        return "spans several lines; give one requirement per item"
    return _line_problem(item.strip())


def requirements_refusals(text: str) -> list[Refusal]:
    """Every line of the requirements file `text` that is not a plain requirement, a comment
    or blank (empty: the file is fine)."""
    refused: list[Refusal] = []
    for number, raw in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        line = raw.removesuffix("\r")
        content = _COMMENT.sub("", line).strip()
        if not content:
            continue
        why = _line_problem(content)
        if why is not None:
            refused.append(Refusal(line=number, text=line.strip(), reason=why))
    return refused


def _line_problem(content: str) -> str | None:
    """Why the requirement `content` (no comment, stripped) is refused, or None."""
    if any(not ch.isprintable() and ch != "\t" for ch in content):
        return "holds a control character; a requirement is printable text"
    if content.startswith("-"):
        return f"is an option (-r, -c, -e, --index-url, --find-links, …); {_WHY_ONLY}"
    if content.endswith("\\"):
        return ("ends with '\\' (a line continuation); write each requirement on one line "
                "of its own")
    if re.search(r"\s-", content):
        return (f"carries an option (--hash, --config-settings, …); {_WHY_ONLY}, and "
                "options are not taken")
    if "$" in content:
        return ("names an environment variable ('$'); a requirement is expanded by nothing "
                "(write the value itself)")
    try:
        req = Requirement(content)
    except InvalidRequirement as exc:
        if "://" in content or content.lower().startswith(("file:", *VCS_PREFIXES)):
            return f"is a URL; {_WHY_ONLY}"
        if content.startswith((".", "/", "~")) or "/" in content or "\\" in content:
            return f"is a path; {_WHY_ONLY}"
        return (f"is not a requirement ('name', 'name==1.2', 'name[extra]>=1; marker'): "
                f"{str(exc).splitlines()[0]}")
    if req.url is not None:
        url = req.url.lower()
        kind = ("a file: URL" if url.startswith("file:") else
                "a path" if url.startswith((".", "/", "~")) else
                "a VCS URL" if url.startswith(VCS_PREFIXES) else "a direct URL")
        return f"is {kind} ('name @ …'); {_WHY_ONLY}"
    if req.name.lower().endswith(ARCHIVE_SUFFIXES):
        return f"is a path to an archive or a wheel; {_WHY_ONLY}"
    return None


def _shown(text: str) -> str:
    """The offending line as a refusal quotes it: short, and printable."""
    short = text[:SHOWN_CHARS] + ("…" if len(text) > SHOWN_CHARS else "")
    return repr(short)
