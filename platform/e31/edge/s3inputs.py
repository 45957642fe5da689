"""A job's `s3://` inputs: never from the artifact store, never with its credentials.

The artifact store (`artifacts_url = "s3://bucket/prefix"`) holds every tenant's outputs,
logs, checkpoints and bundles under `<prefix>/<tenant>/<job>/`; the API serves them to their
owner only. A tenant naming `s3://<bucket>/<prefix>/<another tenant>/<job>/outputs/...` as an
input would get another tenant's files if the worker read it with the store's credentials.
So (docs/security.md):

- an input in the artifact store's bucket beneath its prefix (the whole bucket for a store
  without prefix) is refused: 403 naming the input at submit (`e31.api.services.bundles`), and the
  worker refuses it again before it reads (`e31_worker.attempt.inputs`), so a spec that
  reached the queue some other way is not read either;
- the worker reads other `s3://` inputs with `input_storage_options`: anonymously, or with
  the inputs' own credentials (`E31_INPUTS_S3_*`), never the store's (`E31_S3_*`); settings
  that would make both the same are refused when they load (`same_credentials`).

An array's outputs (`array:<id>/outputs`) are how a job reads earlier outputs: checked as its
tenant's, read by the store.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from e31.edge.settings import Settings

S3_SCHEME = re.compile(r"(?i)s3://")


def _bucket_key(url: str) -> tuple[str, str]:
    """(bucket, key) of an `s3://bucket/key` URL, as s3fs splits it (no userinfo, no port)."""
    rest = S3_SCHEME.sub("", url, count=1)
    bucket, _, key = rest.partition("/")
    return bucket.lower(), key


def _forms(key: str) -> set[str]:
    """The key as written and as a store or a proxy might read it: leading and repeated
    slashes dropped, `.` and `..` resolved, any `?query` cut."""
    key = key.split("?", 1)[0]
    collapsed = re.sub("/+", "/", key).lstrip("/")
    return {key, key.lstrip("/"), collapsed, posixpath.normpath("/" + collapsed).lstrip("/")}


def artifact_store_input(url: str, artifacts_url: str) -> str | None:
    """Why the `s3://` input `url` may not be read (it names the artifact store's own
    objects, or is a chained fsspec URL), or None."""
    if "::" in url:
        return "a chained URL (::) is not an input; name the object: s3://bucket/key"
    if not S3_SCHEME.match(artifacts_url):
        return None
    bucket, key = _bucket_key(url)
    store_bucket, store_prefix = _bucket_key(artifacts_url)
    prefix = store_prefix.strip("/")
    if bucket != store_bucket or bucket == "":
        return None
    if prefix and not any(k == prefix or k.startswith(prefix + "/") for k in _forms(key)):
        return None
    where = f"s3://{store_bucket}/{prefix}" if prefix else f"s3://{store_bucket}"
    return (f"{where} is this pool's artifact store: a job reads its tenant's earlier outputs "
            "as array:<id>/outputs inputs (or downloads them through the API), never from "
            "the store's bucket")


def input_storage_options(settings: Settings) -> dict[str, Any]:
    """s3fs's arguments for reading `s3://` inputs: the inputs' endpoint, and their own
    credentials, else anonymous (`inputs_s3_anonymous`), else botocore's default chain;
    never the artifact store's (E31_S3_*)."""
    options: dict[str, Any] = {}
    if settings.inputs_s3_endpoint_url:
        options["endpoint_url"] = settings.inputs_s3_endpoint_url
    if settings.inputs_s3_access_key_id:
        options["key"] = settings.inputs_s3_access_key_id
        options["secret"] = settings.inputs_s3_secret_access_key
    elif settings.inputs_s3_anonymous:
        options["anon"] = True
    return options


def same_credentials(settings: Settings) -> str | None:
    """Why these settings would read inputs with the artifact store's credentials, or None."""
    if not settings.resolved_artifacts_url.startswith("s3://"):
        return None
    if settings.inputs_s3_access_key_id:
        if settings.inputs_s3_access_key_id == settings.s3_access_key_id:
            return ("E31_INPUTS_S3_ACCESS_KEY_ID is the artifact store's own key "
                    "(E31_S3_ACCESS_KEY_ID); give inputs credentials of their own")
        return None
    if not settings.inputs_s3_anonymous and not settings.s3_access_key_id:
        return ("E31_INPUTS_S3_ANONYMOUS=false with no E31_INPUTS_S3_ACCESS_KEY_ID reads inputs "
                "with botocore's default chain, which is also the artifact store's (no "
                "E31_S3_ACCESS_KEY_ID); give either its own credentials")
    return None
