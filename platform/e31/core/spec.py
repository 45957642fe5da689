"""`JobSpec`: the job description and its validation.

The model's validators are the one set of rules. A request body meets them once, when the
API's route takes it as a `JobSpec`; any other untrusted input (an array item, a spec file)
meets them through `JobSpec.parse`. Either way a refusal is a `SpecError` whose entries,
worded by `describe_error`, name the field and the reason.

Its parts are modules of their own: `strict` (the strict model every part is: `true` is no
number and `"9"` no integer), `names` (what a name, a variable and an argument may hold),
`resources`, `retries`, `pythonenv`, and the inputs and code of `bundles`. The caps an
installation sets on what one request may carry (settings `max_*`, docs/security.md) are
`requestlimits.SpecLimits`: per job, and for all the jobs of one request together through a
`RequestTally`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from e31.core.bundles import MAX_INPUTS, CodeRef, InputName, InputSource
from e31.core.errors import SpecError
from e31.core.names import ENV_NAME, NAME_MAX, SECRET_NAME_MAX, check_name, no_nul, reserved_env
from e31.core.pythonenv import PythonEnv
from e31.core.resources import Resources
from e31.core.retries import RetryPolicy
from e31.core.strict import STORED, Strict, Whole, WholeOrNone

MAX_TIMEOUT_S = 14 * 86400    # two weeks: longer runs should checkpoint and resubmit
DEFAULT_TIMEOUT_S = 86400     # one day, like a typical SLURM partition default
MAX_PARAMS_BYTES = 1024 * 1024  # params travel through the store; data belongs in files
MAX_AFTER = 64                # dependencies per job: a wider fan-in belongs in one array
MAX_SECRETS = 64              # secrets per job: as many as any job's credentials

# Names are ASCII; the API's OpenAPI schema (e31.api.schema) states these same patterns.
ENTRYPOINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$")
_ITEM_REASON = re.compile(r"^((?:after|pip|secrets)\[\d+\]): (.*)$", re.DOTALL)
_FIELD_REASON = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+): (.*)$", re.DOTALL)  # a nested field
SECRET_IN_ENV = "is also in env; give it one way"   # after the secret's name
DEP_ID = re.compile(r"^[ja]-[0-9a-f]{20}$")   # a job id j-… or an array id a-…


class JobSpec(Strict):
    """A job as submitted: what to run, with what, for how long, how often."""

    name: str | None = Field(default=None, max_length=NAME_MAX)
    entrypoint: str | None = Field(
        default=None, description="module:function, called as fn(ctx, **params)")
    command: list[str] | None = Field(default=None, description="argv of a command job")
    params: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the job")
    resources: Resources = Resources()
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S,
                             description="wall-clock limit per attempt")
    retries: RetryPolicy = RetryPolicy()
    priority: Whole = Field(default=5, ge=0, le=9, description="0..9, higher first")
    workload: str | None = Field(default=None, exclude=True,
                                 description="a built-in workload by short name (batch-inference, "
                                             "train, footage) instead of an entrypoint")
    after: list[str] = Field(default_factory=list, max_length=MAX_AFTER,
                             description="job ids (j-…) or array ids (a-…) of the same tenant "
                                         "that must all succeed before this job runs")
    python: PythonEnv | None = Field(
        default=None, description="the job's own environment: pip requirements and a "
                                  "requirements file, installed over the worker's packages")
    code: CodeRef | None = Field(default=None,
                                 description="the job's code: a bundle this tenant uploaded, "
                                             "'sha256:<hex>' (the client sets it from workdir)")
    inputs: dict[InputName, InputSource] = Field(
        default_factory=dict, max_length=MAX_INPUTS,
        description="NAME: SOURCE, staged into $E31_INPUT_DIR/NAME before the job starts: a "
                    "file://, s3:// or http(s):// URL, or bundle:sha256:<hex>/<entry> (a local "
                    "path the client uploaded)")
    network: Literal["none"] | None = Field(
        default=None, description="'none': the job gets no network at all, not even the "
                                  "worker's loopback (needs a sandboxed worker, docs/security.md)")
    idle_timeout_s: WholeOrNone = Field(
        default=None, gt=0, le=MAX_TIMEOUT_S,
        description="seconds without log output, progress or GPU use after which the running "
                    "job counts as idle (docs/jobs.md); default: the pool's idle_timeout_s")
    on_idle: Literal["flag", "kill"] = Field(
        default="flag", description="'flag': show an idle job in its status and the metrics; "
                                    "'kill': also stop it, with reason idle")
    secrets: list[str] = Field(
        default_factory=list, max_length=MAX_SECRETS,
        description="names of the tenant's secrets (e31 secret set NAME), each given to the job "
                    "as the environment variable of that name when an attempt starts; the "
                    "values never travel with the spec")

    allow_pending: bool = Field(
        default=False,
        description="store the job even when no registered node has the GPUs it asks for "
                    "(otherwise refused with 422); it waits, and its pending reason says what "
                    "is missing, until such a node joins the pool")
    preemptible: bool | None = Field(
        default=None,
        description="whether the scheduler may stop a running attempt (SIGTERM, then its "
                    "grace to checkpoint) to give its GPUs to a job of a higher priority band "
                    "or of a tenant below its fair share; it is requeued with reason "
                    "preempted and resumes from its checkpoint (docs/scheduling.md). Default: "
                    "true for the training workload, which checkpoints; false otherwise")

    @model_validator(mode="before")
    @classmethod
    def _workload_alias(cls, data: Any) -> Any:
        """`workload: train` stands for the built-in workload's entrypoint (e31.core.workloads)."""
        if isinstance(data, dict) and isinstance(data.get("workload"), str) \
                and data.get("entrypoint") is None and data.get("command") is None:
            from e31.core.workloads import WORKLOADS
            if data["workload"] in WORKLOADS:
                data = {**data, "entrypoint": WORKLOADS[data["workload"]]}
        return data

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, v: str | None, info: ValidationInfo) -> str | None:
        from e31.core.workloads import WORKLOADS
        if v is None:
            return v
        if v not in WORKLOADS:
            raise ValueError(f"unknown workload {v!r}; known: {', '.join(sorted(WORKLOADS))}")
        if info.data.get("command") is not None or info.data.get("entrypoint") != WORKLOADS[v]:
            raise ValueError("give a workload or an entrypoint or a command, not two")
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str | None) -> str | None:
        if v is not None and not ENTRYPOINT.fullmatch(v):
            raise ValueError("must look like 'package.module:function'")
        return v

    @field_validator("command")
    @classmethod
    def _command_form(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0]):
            raise ValueError("must be a non-empty argv list")
        for arg in v or []:
            no_nul(arg, "an argument")
        return v

    @field_validator("after")
    @classmethod
    def _after_ids(cls, v: list[str]) -> list[str]:
        for i, dep in enumerate(v):
            if not DEP_ID.fullmatch(dep):
                raise ValueError(f"after[{i}]: {dep[:64]!r} is not a job id (j-…) or an "
                                 "array id (a-…)")
        return list(dict.fromkeys(v))   # a dependency named twice counts once

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: list[str], info: ValidationInfo) -> list[str]:
        env = info.data.get("env") or {}
        for i, name in enumerate(v):
            if not ENV_NAME.fullmatch(name) or len(name) > SECRET_NAME_MAX:
                raise ValueError(f"secrets[{i}]: {name[:64]!r} is not a secret's name (an "
                                 f"environment variable's: letters, digits, _; at most "
                                 f"{SECRET_NAME_MAX} characters)")
            if reserved_env(name):
                raise ValueError(f"secrets[{i}]: {name} is set by the worker and cannot be "
                                 "overridden")
            if name in env:
                raise ValueError(f"secrets[{i}]: {name} {SECRET_IN_ENV}")
        return list(dict.fromkeys(v))   # a secret named twice is given once

    @field_validator("name")
    @classmethod
    def _name_text(cls, v: str | None) -> str | None:
        return check_name(no_nul(v, "the name")) if v is not None else v

    @field_validator("params")
    @classmethod
    def _params_json(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            text = json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"must be JSON: {exc}") from exc
        if len(text) > MAX_PARAMS_BYTES:
            raise ValueError(f"larger than {MAX_PARAMS_BYTES} bytes; pass data as a file path")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a variable name (letters, digits, _)")
            if reserved_env(key):
                raise ValueError(f"{key} is set by the worker and cannot be overridden")
            no_nul(value, f"the value of {key}")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> JobSpec:
        if (self.entrypoint is None) == (self.command is None):
            raise ValueError("give exactly one of entrypoint or command")
        if self.command is not None and self.params:
            raise ValueError("params go with an entrypoint; a command job takes its argv")
        return self

    @model_validator(mode="after")
    def _requirements_need_code(self) -> JobSpec:
        if self.python is not None and self.python.requirements is not None and self.code is None:
            raise ValueError("python.requirements: the file is read from the job's code: give "
                             "the job a workdir (code) that holds it")
        return self

    @property
    def kind(self) -> str:
        return "entrypoint" if self.entrypoint else "command"

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if self.workload:    # a built-in workload is named for itself, not for its function
            return self.workload
        if self.entrypoint:
            return self.entrypoint.rsplit(":", 1)[1][:NAME_MAX]
        return Path((self.command or ["job"])[0]).name[:NAME_MAX] or "job"

    @property
    def is_preemptible(self) -> bool:
        """`preemptible` as given, or by default whether the job is the training workload,
        the built-in workload that checkpoints and resumes."""
        if self.preemptible is not None:
            return self.preemptible
        from e31.core.workloads import WORKLOADS
        return self.entrypoint == WORKLOADS["train"]

    def with_retry_defaults(self, pool: RetryPolicy) -> JobSpec:
        """This spec with the retry fields its submitter left out taken from `pool` (the pool's
        `[retries]` setting). Both parts are valid already, so nothing is validated again."""
        given = {name: getattr(self.retries, name) for name in self.retries.model_fields_set}
        return self.model_copy(update={"retries": pool.model_copy(update=given)})

    @classmethod
    def parse(cls, data: Any, *, stored: bool = False) -> JobSpec:
        """Validate untrusted input; raise `SpecError` naming each bad field and why.
        `stored`: a spec read back from the store, which a check added since it was stored
        (what a pip requirement may be) must not make unreadable; the worker checks it."""
        if not isinstance(data, Mapping):
            raise SpecError.one("spec", "must be a mapping of fields")
        try:
            return cls.model_validate(dict(data), context={STORED: True} if stored else None)
        except ValidationError as exc:
            raise SpecError([describe_error(e) for e in exc.errors()]) from exc


def describe_error(error: Any) -> dict[str, str]:
    loc = [str(p) for p in error.get("loc", ()) if p != "[key]"]   # a mapping's bad key
    field = ".".join(loc) or "spec"
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        reason = "unknown field"
    elif kind == "missing":
        reason = "required"
    else:
        reason = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if loc and loc[-1] in ("after", "pip", "secrets") and (m := _ITEM_REASON.match(reason)):
        field, reason = ".".join([*loc[:-1], m.group(1)]), m.group(2)   # python.pip[2]: why
    elif not loc and "entrypoint or command" in reason:
        field = "entrypoint"
    elif not loc and "params go with" in reason:
        field = "params"
    elif not loc and (m := _FIELD_REASON.match(reason)):
        field, reason = m.group(1), m.group(2)          # python.requirements: why
    return {"field": field, "reason": reason}


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a spec file (JSON or YAML) into a mapping; `JobSpec.parse` validates it."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError.one("spec", f"cannot read {p}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        form = "JSON" if p.suffix == ".json" else "YAML"
        raise SpecError.one("spec", f"{p} is not valid {form}: "
                                    f"{str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise SpecError.one("spec", f"{p} must hold a mapping of fields")
    return data
