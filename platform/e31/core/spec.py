"""`JobSpec` and its parts: the job description and its validation.

The model's validators are the one set of rules. A request body meets them once, when the
API's route takes it as a `JobSpec`; any other untrusted input (an array item, a spec file)
meets them through `JobSpec.parse`. Either way a refusal is a `SpecError` whose entries,
worded by `describe_error`, name the field and the reason.

Types are strict: `true` is no number and `"9"` no integer (a whole number may stand for a
float, and a float without a fraction, `2.0`, for an integer: JSON Schema counts it as one, and
the API's OpenAPI schema is JSON Schema). Names are printable text. The caps an installation
sets on what one request may carry (settings `max_*`, docs/security.md) are `SpecLimits`: per
job, and for all the jobs of one request together through a `RequestTally`.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from e31.core.bundles import MAX_INPUTS, CodeRef, InputName, InputSource
from e31.core.errors import SpecError
from e31.core.requirements import requirement_problem

MAX_GPUS_PER_JOB = 8          # one node's worth; multi-node jobs are out of scope
MAX_TIMEOUT_S = 14 * 86400    # two weeks: longer runs should checkpoint and resubmit
DEFAULT_TIMEOUT_S = 86400     # one day, like a typical SLURM partition default
MAX_PARAMS_BYTES = 1024 * 1024  # params travel through the store; data belongs in files
MAX_HOST_MEM_GB = 16384       # host memory per job: more than any node has, so a typo is caught
MAX_DISK_GB = 1024 * 1024     # disk per attempt (a PiB): the pool's attempt_disk_max_gb is the
#                               real cap
MAX_AFTER = 64                # dependencies per job: a wider fan-in belongs in one array
STORED = "stored"             # validation context of a spec read back from the store
MAX_PIP = 64                  # pip requirements per job: more belong in a requirements file
MAX_REQUIREMENT_CHARS = 1000  # one pip requirement; a URL requirement fits in it
MAX_SECRETS = 64              # secrets per job: as many as any job's credentials
SECRET_NAME_MAX = 100         # a secret's name (the store's secrets.name)

# Names are ASCII; the API's OpenAPI schema (e31.api.schema) states these same patterns.
ENTRYPOINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ITEM_REASON = re.compile(r"^((?:after|pip|secrets)\[\d+\]): (.*)$", re.DOTALL)
_FIELD_REASON = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+): (.*)$", re.DOTALL)  # a nested field
DEP_ID = re.compile(r"^[ja]-[0-9a-f]{20}$")   # a job id j-… or an array id a-…
NAME_MAX = 200
# Not text a name may hold: control characters (newline, escape, DEL, C1), lone surrogates,
# line and paragraph separators. A newline in a name would start a forged line in a log.
_NOT_TEXT = frozenset({"Cc", "Cs", "Zl", "Zp"})


def _no_nul(value: str, what: str) -> str:
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


def _whole(value: Any) -> Any:
    """A float without a fraction (`2.0`) as the integer it is; anything else as it came."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Whole = Annotated[int, BeforeValidator(_whole)]
"""An integer field: an int, or a float without a fraction; never a bool or a string."""
WholeOrNone = Annotated[int | None, BeforeValidator(_whole)]
"""`Whole` or None. (`Whole | None` would write a field's bounds into its JSON Schema as
pydantic's `gt`/`le` rather than `exclusiveMinimum`/`maximum`.)"""


class _Strict(BaseModel):
    # strict: no `true` for a number, no "9" for an int; finite numbers only.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Resources(_Strict):
    """What a job needs: GPUs and their memory, or a size class by name."""

    gpus: Whole = Field(default=1, ge=0, le=MAX_GPUS_PER_JOB,
                      description="GPUs on one node; 0 means the cpu class")
    gpu_mem_gb: float | None = Field(
        default=None, gt=0, description="memory per GPU; picks the smallest class that fits")
    size_class: str | None = Field(
        default=None, description="a size class by name, instead of gpu_mem_gb")
    mem_gb: float | None = Field(
        default=None, gt=0, le=MAX_HOST_MEM_GB,
        description="host memory the job may use; past it the kernel OOM-kills the job "
                    "(reason oom) where workers have cgroups")
    disk_gb: float | None = Field(
        default=None, gt=0, le=MAX_DISK_GB,
        description="disk the attempt's scratch, outputs and checkpoints may fill together; "
                    "past it the attempt ends with reason disk_quota; default: the pool's "
                    "attempt_disk_gb, at most its attempt_disk_max_gb")
    on_oom: Literal["fail", "next_class"] | None = Field(
        default=None,
        description="after an attempt that ran out of memory (reason oom): 'next_class' queues "
                    "the job again in the next bigger size class, 'fail' retries it in its own "
                    "class like any failure; default: the pool's on_oom_default")

    @model_validator(mode="after")
    def _consistent(self) -> Resources:
        if self.gpus == 0 and self.gpu_mem_gb is not None:
            raise ValueError("gpu_mem_gb needs gpus >= 1")
        return self


class RetryPolicy(_Strict):
    """How often a failed attempt is retried, with exponential back-off."""

    max: Whole = Field(default=0, ge=0, le=100, description="retries after the first attempt")
    backoff_s: float = Field(default=10.0, ge=0, le=86400)
    backoff_max_s: float = Field(default=600.0, ge=0, le=7 * 86400)
    max_lost: Whole = Field(default=3, ge=1, le=100,
                          description="attempts lost with their worker before the job fails "
                                      "as a poison job (lost attempts are not retries)")

    def delay_s(self, attempt: int) -> float:
        """Back-off before the attempt after `attempt` (1-based): backoff_s × 2^(attempt-1),
        capped at backoff_max_s."""
        return min(self.backoff_max_s, self.backoff_s * (2 ** max(0, attempt - 1)))


class PythonEnv(_Strict):
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
        path = PurePosixPath(_no_nul(v, "the path"))
        if path.is_absolute() or ".." in path.parts or "\\" in v:
            raise ValueError("must be a relative path inside the job's code, without '..'")
        return v


class JobSpec(_Strict):
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
            _no_nul(arg, "an argument")
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
                raise ValueError(f"secrets[{i}]: {name} is also in env; give it one way")
        return list(dict.fromkeys(v))   # a secret named twice is given once

    @field_validator("name")
    @classmethod
    def _name_text(cls, v: str | None) -> str | None:
        return check_name(_no_nul(v, "the name")) if v is not None else v

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
            _no_nul(value, f"the value of {key}")
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


def env_bytes(env: Mapping[str, str]) -> int:
    """What `env` takes in a process's environment: `NAME=value` and a NUL for each variable."""
    return sum(len(k) + len(v.encode()) + 2 for k, v in env.items())


def argv_bytes(argv: Sequence[str]) -> int:
    """What `argv` takes on a process's command line: each argument and a NUL."""
    return sum(len(a.encode()) + 1 for a in argv)


def spec_bytes(spec: JobSpec) -> int:
    """The free-form text a job brings to the store: its name, env, argv, pip requirements,
    inputs and params, in bytes (params as their JSON, as `MAX_PARAMS_BYTES` counts them)."""
    total = len(spec.name.encode()) if spec.name else 0
    total += env_bytes(spec.env) + argv_bytes(spec.command or ())
    total += argv_bytes(spec.python.pip) if spec.python else 0
    total += env_bytes(spec.inputs)     # NAME=source each, as env counts its variables
    return total + (len(json.dumps(spec.params)) if spec.params else 0)


@dataclass(frozen=True)
class SpecLimits:
    """What one request may carry, as an installation sets it (settings `max_env_vars`,
    `max_env_bytes`, `max_argv_bytes`, `max_after_per_request`, `max_spec_bytes_per_request`,
    `attempt_disk_max_gb`; docs/security.md). `check` applies the caps on one job; a
    `RequestTally` the caps on all the jobs of one request together, which an array's
    `defaults` would otherwise multiply."""

    env_vars: int
    env_bytes: int
    argv_bytes: int
    after_per_request: int
    spec_bytes_per_request: int
    disk_gb: float | None = None     # the most `resources.disk_gb` may ask; None: the spec's own

    def check(self, spec: JobSpec) -> list[dict[str, str]]:
        """The caps on one job that `spec` passes, each as an error naming its field."""
        errors: list[dict[str, str]] = []
        if len(spec.env) > self.env_vars:
            errors.append({"field": "env", "reason": f"{len(spec.env)} variables; at most "
                                                     f"{self.env_vars} per job (max_env_vars)"})
        elif (size := env_bytes(spec.env)) > self.env_bytes:
            errors.append({"field": "env", "reason": f"{size} bytes (NAME=value and a NUL each); "
                                                     f"at most {self.env_bytes} per job "
                                                     "(max_env_bytes)"})
        if spec.command is not None and (size := argv_bytes(spec.command)) > self.argv_bytes:
            errors.append({"field": "command", "reason": f"{size} bytes (each argument and a "
                                                         f"NUL); at most {self.argv_bytes} per "
                                                         "job (max_argv_bytes)"})
        asked = spec.resources.disk_gb
        if asked is not None and self.disk_gb is not None and asked > self.disk_gb:
            errors.append({"field": "resources.disk_gb", "reason": (
                f"{asked:g} GB; at most {self.disk_gb:g} GB on this pool (attempt_disk_max_gb)")})
        return errors


@dataclass
class RequestTally:
    """Running totals over the jobs of one request. `add` refuses the request as soon as a
    total passes its cap, so a request far over it costs no more than one just over it."""

    limits: SpecLimits
    field: str | None = None    # what a refusal names: an array's `items`; None: one job's field
    jobs: int = 0
    after: int = 0
    spec_bytes: int = 0

    def add(self, spec: JobSpec) -> None:
        """Count `spec` in; `SpecError` naming the cap when a total passes it."""
        self.jobs += 1
        self.after += len(spec.after)
        if self.after > (cap := self.limits.after_per_request):
            raise SpecError.one(self.field or "after", (
                f"after: {self.after} dependencies in the first {self.jobs} jobs of this "
                f"request; at most {cap} per request, all its jobs together "
                "(max_after_per_request): depend on an array id (a-…) instead of its items"))
        self.spec_bytes += spec_bytes(spec)
        if self.spec_bytes > (cap := self.limits.spec_bytes_per_request):
            raise SpecError.one(self.field or "spec", (
                f"names, env, argv and params take {self.spec_bytes} bytes in the first "
                f"{self.jobs} jobs of this request; at most {cap} per request, all its jobs "
                "together (max_spec_bytes_per_request)"))


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
