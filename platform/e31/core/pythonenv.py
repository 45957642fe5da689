"""`PythonEnv`: the job's own Python environment, as a spec asks for it (docs/jobs.md)."""

from __future__ import annotations

from pathlib import PurePosixPath

from pydantic import Field, ValidationInfo, field_validator

from e31.core.names import NAME_MAX, no_nul
from e31.core.requirements import requirement_problem
from e31.core.strict import STORED, Strict

MAX_PIP = 64                  # pip requirements per job: more belong in a requirements file
MAX_REQUIREMENT_CHARS = 1000  # one pip requirement; a URL requirement fits in it


class PythonEnv(Strict):
    """The job's own Python environment, built by the worker over its own (docs/jobs.md):
    what it adds to the worker's packages, never a different version of one of them."""

    pip: list[str] = Field(default_factory=list, max_length=MAX_PIP,
                           description="requirements to install, as pip takes them: 'pkg==1.2'")
    requirements: str | None = Field(
        default=None, min_length=1, max_length=NAME_MAX,
        description="a requirements file in the job's code (workdir), relative to its root")

    @field_validator("pip")
    @classmethod
    def _requirements(cls, v: list[str], info: ValidationInfo) -> list[str]:
        for i, item in enumerate(v):
            shown = repr(item[:64])
            if len(item) > MAX_REQUIREMENT_CHARS:
                raise ValueError(f"pip[{i}]: {shown}... is longer than {MAX_REQUIREMENT_CHARS} "
                                 "characters")
            if info.context and info.context.get(STORED):
                continue   # a spec stored before the check: the worker refuses it (setup)
            why = requirement_problem(item)   # e31.core.requirements: packages, nothing else
            if why is not None:
                raise ValueError(f"pip[{i}]: {shown} {why}")
        return v

    @field_validator("requirements")
    @classmethod
    def _in_bundle(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = PurePosixPath(no_nul(v, "the path"))
        if path.is_absolute() or ".." in path.parts or "\\" in v:
            raise ValueError("must be a relative path inside the job's code, without '..'")
        return v
