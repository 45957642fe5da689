"""Footage fan-out, the planning part: a source of videos or images into chunk jobs and a merge.

`footage` with a `source` param (a directory, a file, a list of them, `file://` or fsspec
URLs) is expanded at submit by the API (`e31.api.services.fanout`): the files are listed, each
video's duration is probed (PyAV, imported lazily: only the process that plans needs it),
and `plan` returns the chunk jobs' specs (one array) and the merge job's, which runs
`after` the array and reads the items' outputs as its input `array:<id>/outputs`.

The chunk arithmetic, which the workload shares, is `e31.core.footage`'s.
"""

from __future__ import annotations

import os
import posixpath
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from e31.core.addresses import ALLOW_HINT, refusal, url_refusal
from e31.core.bundles import URL_SCHEMES, beneath, file_input_path, input_scheme
from e31.core.errors import SpecError, SpecForbidden
from e31.core.footage import (
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    chunk_bounds,
    decode_threads_ok,
    frames_in,
    is_image,
    is_media,
    list_media,
    probe_duration_s,
)

DEFAULT_CHUNK_S = 600.0    # ten minutes of video per chunk job
# Images per chunk job: each is one staged input, and a job has at most 64 (bundles.MAX_INPUTS).
DEFAULT_CHUNK_IMAGES = 64
MAX_SOURCE_FILES = 10_000  # files of one source; one array holds at most 10,000 items anyway
# Videos probed at once while planning: a probe mostly waits (a remote object's header is a
# few ranged reads; PyAV drops the GIL while it parses), so threads overlap the waits.
PROBE_THREADS = 16
MERGE_ENTRYPOINT = "e31_worker.workloads.footage_merge:merge"
FANOUT_PARAMS = ("source", "chunk_s", "chunk_images")   # read by the planner, not the chunks


@dataclass(frozen=True)
class Plan:
    """A footage source planned: the array's item specs (over the submitted spec) and the
    merge job's spec fields (its `after` and input are added by the store)."""

    items: list[dict[str, Any]]
    merge: dict[str, Any]
    files: list[dict[str, Any]] = field(default_factory=list)


def is_fanout(entrypoint: str | None, params: Mapping[str, Any]) -> bool:
    """Whether a footage spec asks to be fanned out (it names a `source`)."""
    from e31.core.workloads import WORKLOADS
    return entrypoint == WORKLOADS["footage"] and "source" in params


def plan(params: Mapping[str, Any], *, roots: Sequence[str],
         probe: Callable[[str], float] = probe_duration_s,
         allowed: Sequence[str] = ()) -> Plan:
    """The chunk jobs and the merge job of a footage `source` (`SpecError` naming
    `params.<field>` for a bad value, `SpecForbidden` for a local path outside `roots`).

    Local files (`file://` or a plain absolute path) are read here and staged into each
    chunk job as its input (the job's sandbox shows it nothing else); other URLs are read by
    the chunk jobs themselves, a byte range at a time.
    """
    rest = {k: v for k, v in params.items() if k not in FANOUT_PARAMS}
    for bad in ("path", "start_s", "end_s", "names"):
        if bad in rest:
            raise SpecError.one(f"params.{bad}", "set by the fan-out of a source; give source")
    chunk_s = _positive(params, "chunk_s", DEFAULT_CHUNK_S)
    chunk_images = int(_positive(params, "chunk_images", DEFAULT_CHUNK_IMAGES))
    if chunk_images > DEFAULT_CHUNK_IMAGES:
        raise SpecError.one("params.chunk_images", f"at most {DEFAULT_CHUNK_IMAGES} (a job's "
                                                   "inputs)")
    fps = rest.get("fps", 1.0)
    if fps is not None and (not isinstance(fps, int | float) or fps <= 0):
        raise SpecError.one("params.fps", "must be a positive number of frames a second, or "
                                          "null for every frame")
    if not decode_threads_ok(rest.get("decode_threads", 1)):
        raise SpecError.one("params.decode_threads", "must be a whole number of threads, or 0 "
                                                     "for FFmpeg's own count")
    files = _files(params["source"], roots, allowed)
    durations = _durations([(url, name) for url, name in files if not is_image(url)], probe)
    items: list[dict[str, Any]] = []
    planned: list[dict[str, Any]] = []
    images: list[tuple[str, str]] = []
    for url, name in files:
        if is_image(url):
            images.append((url, name))
            continue
        duration = durations[url]
        first = len(items)
        for start, end in chunk_bounds(duration, chunk_s):
            items.append(_item(rest, [(url, name)], start_s=start, end_s=end,
                               frames=frames_in(start, end, fps) if fps else None))
        planned.append({"name": name, "kind": "video", "url": url,
                        "duration_s": round(duration, 6), "items": list(range(first, len(items)))})
    for at in range(0, len(images), chunk_images):
        group = images[at:at + chunk_images]
        planned += [{"name": name, "kind": "image", "url": url, "items": [len(items)]}
                    for url, name in group]
        items.append(_item(rest, group, frames=len(group)))
    planned.sort(key=lambda f: f["items"][0])
    total = sum(i["params"].get("expected_frames") or 0 for i in items)
    merge = {"params": {"files": planned, "total_frames": total,
                        "fps": fps, "labels": rest.get("labels")}}
    return Plan(items=items, merge=merge, files=planned)


def _durations(videos: Sequence[tuple[str, str]], probe: Callable[[str], float]
               ) -> dict[str, float]:
    """Each video's duration, `PROBE_THREADS` probes at a time; the first unreadable one (in
    source order) is a `SpecError` naming it."""
    def one(video: tuple[str, str]) -> float | BaseException:
        try:
            return probe(video[0])
        except Exception as exc:  # noqa: BLE001 - any reader's error is this file's
            return exc

    if len(videos) <= 1:
        found = [one(v) for v in videos]
    else:
        with ThreadPoolExecutor(min(PROBE_THREADS, len(videos)),
                                thread_name_prefix="e31-probe") as pool:
            found = list(pool.map(one, videos))
    durations: dict[str, float] = {}
    for (url, name), duration in zip(videos, found, strict=True):
        if isinstance(duration, BaseException):
            raise SpecError.one("params.source", f"cannot read {name}: {duration}")
        durations[url] = duration
    return durations


def _files(sources: Any, roots: Sequence[str],
           allowed: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(URL the job reads, name in the outputs) of every media file of the `source` param."""
    if isinstance(sources, str):
        sources = [sources]
    if not isinstance(sources, list) or not sources or \
            not all(isinstance(s, str) and s for s in sources):
        raise SpecError.one("params.source", "must be a path or URL, or a non-empty list of them")
    files: list[tuple[str, str]] = []
    for i, source in enumerate(sources):
        field_name = "params.source" if len(sources) == 1 else f"params.source[{i}]"
        files += _listed(source, field_name, roots, allowed)
        if len(files) > MAX_SOURCE_FILES:
            raise SpecError.one("params.source", f"more than {MAX_SOURCE_FILES} files; split it")
    if not files:
        raise SpecError.one("params.source", "holds no video or image file "
                                             f"({', '.join(VIDEO_SUFFIXES + IMAGE_SUFFIXES)})")
    return files


def _item(rest: Mapping[str, Any], group: Sequence[tuple[str, str]], *,
          start_s: float | None = None, end_s: float | None = None,
          frames: int | None) -> dict[str, Any]:
    """One chunk job's spec fields: its params and the inputs it stages."""
    inputs: dict[str, str] = {}
    paths: list[str] = []
    for n, (url, name) in enumerate(group):
        if input_scheme(url) == "file":
            key = f"m{n:02d}{posixpath.splitext(name)[1].lower()}"
            inputs[key] = url
            paths.append(key)
        else:
            paths.append(url)
    params: dict[str, Any] = {**rest, "path": paths, "names": [name for _, name in group]}
    if start_s is not None:
        params.update(start_s=start_s, end_s=end_s)
    if frames is not None:
        params["expected_frames"] = frames
    return {"params": params, "inputs": inputs}


def _positive(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise SpecError.one(f"params.{key}", "must be a positive number")
    return float(value)


# What to do about a local `source` the pool may not read: unlike a job's local input, the
# client does not upload it; the API and the workers read it in place (issue 32, rough edge 17).
SOURCE_HINT = ("the pool reads a local source where it lies, nothing is uploaded: start the pool "
               "with E31_INPUT_FILE_ROOTS naming a directory above it (on one machine: "
               "E31_INPUT_FILE_ROOTS=/that/dir e31 up), or give an s3:// or http(s):// URL")


def _local_refusal(source: str, roots: Sequence[str], why: str) -> str:
    """Why a local `source` is refused, and what to do, where `file_input_path`'s own words
    (`why`) are those of a job's `file://` input, whose other way is an upload."""
    path = posixpath.normpath(unquote(urlsplit(source).path))
    shown = path[:200] if path.isprintable() else repr(path[:200])
    if not roots:
        return f"this pool reads no local directory (input_file_roots is empty); {SOURCE_HINT}"
    if path.startswith("/") and not any(beneath(path, root) for root in roots):
        return (f"{shown} is not beneath input_file_roots ({', '.join(roots)}); "
                f"{SOURCE_HINT}")
    return why


def _listed(source: str, field_name: str, roots: Sequence[str],
            allowed: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(URL, name) of each media file of one source entry, in sorted order; a local path
    only beneath `roots` (resolved: a link out of them is refused too); an `http(s)` one
    only where its host is a public address or in `allowed` (`input_allowed_networks`), as
    for an input: the API reads it here."""
    scheme = input_scheme(source)
    if scheme is None and os.path.isabs(source):
        source, scheme = "file://" + source, "file"
    if scheme is None or scheme not in URL_SCHEMES:
        raise SpecError.one(field_name, "must be an absolute path on the pool, or a URL "
                                        f"({', '.join(s + '://' for s in URL_SCHEMES)})")
    if scheme == "file":
        try:
            path = file_input_path(source, roots)
        except ValueError as exc:
            raise SpecForbidden.one(field_name, _local_refusal(source, roots, str(exc))) from None
        real = os.path.realpath(path)
        if not any(beneath(real, os.path.realpath(root)) for root in roots):
            raise SpecForbidden.one(field_name, f"{path} resolves outside input_file_roots "
                                                f"({', '.join(roots)}); {SOURCE_HINT}")
        if not os.path.exists(real):
            raise SpecError.one(field_name, f"no such file or directory on the pool: {path}")
        found = list_media(real)
        base = real if os.path.isdir(real) else os.path.dirname(real)
        return [("file://" + f, posixpath.relpath(f, base)) for f in found
                if beneath(os.path.realpath(f), real if os.path.isdir(real) else f)
                and is_media(f)]
    if scheme in ("http", "https") and (why := _address_refusal(source, allowed)):
        raise SpecForbidden.one(field_name, f"refused: {why}")
    try:
        found = list_media(source)
    except ImportError as exc:
        raise SpecError.one(field_name, f"this API cannot read {scheme}:// ({exc})") from None
    except (OSError, ValueError) as exc:
        raise SpecError.one(field_name, f"cannot list {source}: {exc}") from None
    base = urlsplit(source).path.rstrip("/")
    return [(f, posixpath.relpath(urlsplit(f).path, base) if len(found) > 1 or f != source
             else posixpath.basename(urlsplit(f).path)) for f in found if is_media(f)]


def _address_refusal(url: str, allowed: Sequence[str]) -> str | None:
    """Why the API may not read the `http(s)` URL `url`: what its text shows, or an address
    its host resolves to (`e31.core.addresses`); None when every one is public or allowed. (The
    listing may still follow a redirect the check does not see: the chunk jobs, which read
    the files, do so from their own network.)"""
    if (why := url_refusal(url, allowed)) is not None:
        return why
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None     # the listing says it cannot reach the host
    for info in infos:
        if (why := refusal(str(info[4][0]), allowed)) is not None:
            return f"its host {host} resolves to {info[4][0]}, {why}; {ALLOW_HINT}"
    return None
