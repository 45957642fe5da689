"""The OpenAPI document, saying of each request what the API takes: no more, no less.

FastAPI derives the document from the models (`JobSpec`, `ArraySubmission`), but a model's
validators say more than its types: patterns, fields that exclude each other, the pool's size
classes and caps. `install` lays those rules over the generated schemas (`JobSpec`,
`Resources`, `PythonEnv`, `ArraySubmission`, the bundle path), so that a body the document
allows is taken and a body it refuses is refused with 422. tests/integration/test_api_fuzz.py
holds the two to each other with schemathesis.

What no schema can say is answered with another status (e31.api.errors): a bundle or dependency
the tenant lacks (409), a file:// input outside `input_file_roots` (403). The byte caps on one
job's `env` and argv and on one request's jobs together (settings `max_*`) and the 1 MiB of
`params` are stated in descriptions only: JSON Schema counts items and characters, not bytes.
An array is described in its two plain forms (complete items; or complete defaults with items
that set the fields no other field depends on); the API also takes any other split of an
item's fields between the item and `defaults` whose merged item is a valid spec.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from e31.core.bundles import DIGEST, INPUT_NAME, MAX_SOURCE_CHARS
from e31.core.names import ENV_NAME, NAME_MAX, SECRET_NAME_MAX
from e31.core.pythonenv import MAX_REQUIREMENT_CHARS
from e31.core.sizeclasses import cpu_class, gpu_classes
from e31.core.spec import DEP_ID, ENTRYPOINT
from e31.core.workloads import WORKLOADS
from e31.edge.settings import Settings
from e31.ops.sweep import MAX_ARRAY_ITEMS

Schema = dict[str, Any]

# A character no name may hold: a control character (C0, DEL, C1), a line or paragraph
# separator (names.check_name). A lone surrogate has no UTF-8, so no JSON body carries one.
CONTROL = "[\\x00-\\x1f\\x7f-\\x9f\\u2028\\u2029]"
NUL = "\\x00"
RESERVED_ENV = {"anyOf": [{"pattern": "^E31_"}, {"const": "CUDA_VISIBLE_DEVICES"}]}
# A pip requirement (PEP 508) as this schema states it: a name, extras, and version
# specifiers; never a URL, a path or an option (e31.core.requirements: a job names packages only).
# pip takes markers too, and more version forms; the API takes what `packaging` parses
# (those forms are stated in the field's description).
_REQ_NAME = "[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_WS = "[ \\t]*"
_VERSION = "[0-9]{1,9}(?:\\.[0-9]{1,9}){0,3}"
_SPECIFIER = (f"(?:(?:==|!=|<=|>=|<|>){_WS}{_VERSION}"
              f"|~={_WS}[0-9]{{1,9}}(?:\\.[0-9]{{1,9}}){{1,3}})")
_EXTRAS = f"\\[{_WS}(?:{_REQ_NAME}(?:{_WS},{_WS}{_REQ_NAME})*)?{_WS}\\]"
REQUIREMENT = (f"^{_WS}{_REQ_NAME}{_WS}(?:{_EXTRAS})?{_WS}"
               f"(?:{_SPECIFIER}(?:{_WS},{_WS}{_SPECIFIER})*)?{_WS}$")
# An input's source: a URL of a scheme the worker reads (any case), or an uploaded bundle's
# entry, a file name at its top (printable ASCII here; the API takes any printable text).
URL_SOURCE = "^(?:[Ff][Ii][Ll][Ee]|[Ss]3|[Hh][Tt][Tt][Pp][Ss]?)://"
BUNDLE_SOURCE = "^bundle:sha256:[0-9a-f]{64}/[ -.0-~]+$"
NOT_AN_ENTRY = {"anyOf": [{"pattern": "/\\.\\.?$"}, {"pattern": "\\n"}]}
# A requirements file is a relative path inside the job's code, without `..` or `\`.
NOT_A_RELATIVE_PATH = {"anyOf": [{"pattern": "^/"}, {"pattern": "\\\\"}, {"pattern": NUL},
                                 {"pattern": "(?:^|/)\\.\\.(?:/|$)"}]}
# Item fields of an array with complete defaults: none changes what another field may be.
OVERRIDES = ("name", "env", "after", "inputs", "priority", "timeout_s", "retries", "resources",
             "network", "idle_timeout_s", "on_idle", "allow_pending", "preemptible")

# A dry run's answer (e31.api.services.jobs.JobService.dry_run): a footage source's answers only
# `dry_run`, `name` and `fanout`; a job's also where and when it could start.
_TEXT_OR_NULL = {"type": ["string", "null"]}
DRY_RUN: Schema = {"type": "object", "required": ["dry_run"], "properties": {
    "dry_run": {"const": True},
    "size_class": {"type": "string"}, "queue": {"type": "string"}, "gpus": {"type": "integer"},
    "could_run_now": {"type": "boolean",
                      "description": "a live idle worker serves its queue and nothing goes first"},
    "where": {"anyOf": [{"type": "null"}, {
        "type": "object", "required": ["worker", "host"],
        "properties": {"worker": {"type": "string"}, "host": {"type": "string"}}}]},
    "estimated_start": {**_TEXT_OR_NULL, "description": "ISO 8601; null: no estimate"},
    "pending": {"anyOf": [{"type": "null"}, {
        "type": "object", "required": ["reason", "text"],
        "description": "why it would wait, as a queued job's status says it",
        "properties": {"reason": {"type": "string"}, "text": {"type": "string"},
                       "no_estimate": _TEXT_OR_NULL}}]},
}}


def install(app: FastAPI, settings: Settings) -> None:
    """Serve the document with the rules of this pool (`settings`) laid over FastAPI's."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version,
                              description=app.description, routes=app.routes)
            tighten(doc, settings)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def tighten(doc: dict[str, Any], settings: Settings) -> None:
    """Lay the validators' rules over the generated schemas of `doc`, in place."""
    schemas = doc["components"]["schemas"]
    schemas["JobSpec"] = job_spec(schemas["JobSpec"], settings)
    schemas["Resources"] = resources(schemas["Resources"], settings)
    schemas["PythonEnv"] = python_env(schemas["PythonEnv"])
    schemas["ArraySubmission"] = array_submission(schemas["ArraySubmission"], schemas["JobSpec"])
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    for path, methods in doc["paths"].items():
        for operation in methods.values():
            for param in operation.get("parameters", ()):
                if param["in"] == "path" and param["name"] == "digest":
                    param["schema"] = {**param["schema"], "pattern": DIGEST.pattern}
            # FastAPI adds a 422 of its own body to every route with a parameter; the routes
            # that can answer 422 declare it with ErrorBody (e31.api.errors.responses).
            if _is_fastapis_422(operation["responses"].get("422")):
                del operation["responses"]["422"]
        if path.startswith("/v1/bundles/") and "put" in methods:
            methods["put"]["requestBody"] = {
                "required": True, "description": "an uncompressed tar (the client sends it as "
                                                 "application/x-tar; any type is read as bytes)",
                "content": {"application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"}}}}
    _link_created(doc, "/v1/jobs", "job_id", ("/v1/jobs/{job_id}", "get"),
                  ("/v1/jobs/{job_id}/cancel", "post"), ("/v1/jobs/{job_id}/logs", "get"),
                  ("/v1/jobs/{job_id}/outputs", "get"))
    _link_created(doc, "/v1/arrays", "array_id", ("/v1/arrays/{array_id}", "get"),
                  ("/v1/arrays/{array_id}/manifest", "get"),
                  ("/v1/arrays/{array_id}/cancel", "post"))
    doc["paths"]["/v1/jobs"]["post"]["responses"]["200"]["content"] = {"application/json": {
        "schema": DRY_RUN}}


def _link_created(doc: dict[str, Any], path: str, param: str,
                  *targets: tuple[str, str]) -> None:
    """Say that the `id` a POST to `path` answers (201) is the `param` of `targets`: OpenAPI
    links, which clients and schemathesis's stateful tests follow."""
    created = doc["paths"][path]["post"]["responses"]["201"]
    created["content"]["application/json"]["schema"] = {
        "type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}
    created["links"] = {
        re.sub(r"[^A-Za-z0-9]+", "_", f"{method}{target}").strip("_"): {
            "operationRef": f"#/paths/{target.replace('/', '~1')}/{method}",
            "parameters": {param: "$response.body#/id"}}
        for target, method in targets}


def _is_fastapis_422(response: Schema | None) -> bool:
    content = (response or {}).get("content", {}).get("application/json", {})
    return str(content.get("schema", {}).get("$ref", "")).endswith("/HTTPValidationError")


def _nullable(schema: Schema, generated: Schema) -> Schema:
    """`schema` or null, with what FastAPI said of the field (title, description, default)."""
    return {**_about(generated), "anyOf": [schema, {"type": "null"}]}


def _about(generated: Schema) -> Schema:
    return {k: v for k, v in generated.items() if k in ("title", "description", "default")}


def job_spec(generated: Schema, settings: Settings) -> Schema:
    """`JobSpec`: each field as its validator takes it, and the rules between fields."""
    p = generated["properties"]
    text = {"type": "string", "maxLength": NAME_MAX, "not": {"pattern": CONTROL}}
    props = {
        **p,
        "name": _nullable(text, p["name"]),
        "entrypoint": _nullable({"type": "string", "pattern": ENTRYPOINT.pattern},
                                p["entrypoint"]),
        "command": _nullable({"type": "array", "minItems": 1,
                              "prefixItems": [{"type": "string", "minLength": 1,
                                               "not": {"pattern": NUL}}],
                              "items": {"type": "string", "not": {"pattern": NUL}}},
                             p["command"]),
        "env": {**_about(p["env"]), "type": "object", "maxProperties": settings.max_env_vars,
                "propertyNames": {"pattern": ENV_NAME.pattern, "not": RESERVED_ENV},
                "additionalProperties": {"type": "string", "not": {"pattern": NUL}}},
        "workload": _nullable({"enum": sorted(WORKLOADS)}, p["workload"]),
        "after": {**p["after"], "items": {"type": "string", "pattern": DEP_ID.pattern}},
        "secrets": {**p["secrets"], "items": {"type": "string", "pattern": ENV_NAME.pattern,
                                              "maxLength": SECRET_NAME_MAX, "not": RESERVED_ENV}},
        "code": _nullable({"type": "string", "pattern": DIGEST.pattern}, p["code"]),
        "inputs": {**p["inputs"], "propertyNames": {"pattern": INPUT_NAME.pattern},
                   "additionalProperties": {
                       "type": "string", "maxLength": MAX_SOURCE_CHARS,
                       "anyOf": [{"pattern": URL_SOURCE},
                                 {"pattern": BUNDLE_SOURCE, "not": NOT_AN_ENTRY}]}},
    }
    props["env"]["description"] = (f"{p['env'].get('description', '')}; at most "
                                   f"{settings.max_env_bytes} bytes of NAME=value (max_env_bytes)")
    kind = [
        {"required": ["entrypoint"], "properties": {
            "entrypoint": {"type": "string"}, "command": {"type": "null"},
            "workload": {"type": "null"}}},
        {"required": ["command"], "properties": {
            "command": {"type": "array"}, "entrypoint": {"type": "null"},
            "workload": {"type": "null"}, "params": {"maxProperties": 0}}},
        *({"required": ["workload"], "properties": {
            "workload": {"const": name}, "command": {"type": "null"},
            "entrypoint": {"anyOf": [{"type": "null"}, {"const": entrypoint}]}}}
          for name, entrypoint in sorted(WORKLOADS.items())),
    ]
    requirements_need_code = [
        {"properties": {"python": {"anyOf": [
            {"type": "null"}, {"properties": {"requirements": {"type": "null"}}}]}}},
        {"required": ["code"], "properties": {"code": {"type": "string"}}},
    ]
    return {**generated, "properties": props,
            "allOf": [{"anyOf": kind}, {"anyOf": requirements_need_code}],
            "description": f"{generated.get('description', '')} Exactly one of entrypoint, "
                           "command or workload; params only with an entrypoint; "
                           "python.requirements only with code."}


def resources(generated: Schema, settings: Settings) -> Schema:
    """`Resources` on this pool: a size class by name, or GPUs and their memory that some
    class takes (`e31.core.sizeclasses.route`)."""
    p = generated["properties"]
    classes = settings.size_classes
    cpu = cpu_class(classes)
    biggest = max(c.gpu_mem_gb for c in gpu_classes(classes))
    props = {**p, "size_class": _nullable({"enum": [c.name for c in classes]}, p["size_class"])}

    def fits(max_gb: float) -> Schema:
        return {"anyOf": [{"type": "null"}, {"type": "number", "maximum": max_gb}]}

    ways: list[Schema] = [{"properties": {
        "size_class": {"type": "null"}, "gpus": {"minimum": 1}, "gpu_mem_gb": fits(biggest)}}]
    ways += [{"required": ["size_class"], "properties": {
        "size_class": {"const": c.name}, "gpus": {"minimum": 1},
        "gpu_mem_gb": fits(c.gpu_mem_gb)}} for c in gpu_classes(classes)]
    if cpu is not None:
        no_gpu = {"gpus": {"const": 0}, "gpu_mem_gb": {"type": "null"}}
        ways += [{"required": ["gpus"], "properties": {"size_class": {"type": "null"}, **no_gpu}},
                 {"required": ["size_class", "gpus"],
                  "properties": {"size_class": {"const": cpu.name}, **no_gpu}}]
    return {**generated, "properties": props, "anyOf": ways}


def python_env(generated: Schema) -> Schema:
    """`PythonEnv`: pip requirements by their grammar, the requirements file by its path."""
    p = generated["properties"]
    return {**generated, "properties": {
        **p,
        "pip": {**p["pip"], "items": {"type": "string", "maxLength": MAX_REQUIREMENT_CHARS,
                                      "pattern": REQUIREMENT},
                "description": f"{p['pip'].get('description', '')}; the API also takes "
                               "markers and every version form packaging parses"},
        "requirements": _nullable({"type": "string", "minLength": 1, "maxLength": NAME_MAX,
                                   "not": NOT_A_RELATIVE_PATH}, p["requirements"]),
    }}


def array_submission(generated: Schema, spec: Schema) -> Schema:
    """`ArraySubmission` in its two plain forms (see the module's docstring)."""
    p = generated["properties"]
    ref = {"$ref": "#/components/schemas/JobSpec"}

    def overrides(*extra: str) -> Schema:
        fields = (*OVERRIDES, *extra)
        return {"type": "object", "additionalProperties": False,
                "properties": {k: spec["properties"][k] for k in fields}}

    complete_items = {"properties": {
        "defaults": {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]},
        "items": {"items": ref}}}
    entrypoint_defaults = {"required": ["defaults"], "properties": {
        "defaults": {"allOf": [ref, {"properties": {"command": {"type": "null"}}}]},
        "items": {"items": overrides("params")}}}
    command_defaults = {"required": ["defaults"], "properties": {
        "defaults": {"allOf": [ref, {"required": ["command"],
                                     "properties": {"command": {"type": "array"}}}]},
        "items": {"items": overrides()}}}
    return {**generated, "properties": {
        **p,
        "name": _nullable({"type": "string", "minLength": 1, "maxLength": NAME_MAX,
                           "not": {"pattern": CONTROL}}, p["name"]),
        "items": {**p["items"], "minItems": 1, "maxItems": MAX_ARRAY_ITEMS,
                  "items": {"type": "object"}},
    }, "anyOf": [complete_items, entrypoint_defaults, command_defaults]}
