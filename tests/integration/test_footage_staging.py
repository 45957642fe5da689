"""A local footage file staged for a chunk job without a copy (`e31_worker.attempt.inputs`):
a link in `$E31_INPUT_DIR` to the source, which the sandbox binds read-only. The job reads it
and nothing beside it, and cannot change it; without the sandbox the same link would hand it
the source to write, which is why a worker without one copies. Skipped, saying why, where
this machine cannot give a sandbox."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from e31.core.records import Claim
from e31_worker.attempt.binds import protected_paths
from e31_worker.attempt.inputs import copied_bytes, link_local_file, stage_inputs
from tests.integration.test_sandbox import TENANT, Jail, python

VIDEO = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 64   # the bytes stand for a video
PROBE = """
import errno, json, os, sys
staged = os.path.join(os.environ['E31_INPUT_DIR'], 'm00.mp4')
real = os.path.realpath(staged)
out = {'read': len(open(staged, 'rb').read())}
def attempt(what, fn):
    try:
        fn()
        out[what] = 'done'
    except OSError as exc:
        out[what] = errno.errorcode[exc.errno]
attempt('write', lambda: open(staged, 'r+b').write(b'X'))
attempt('chmod', lambda: os.chmod(real, 0o777))
attempt('sibling', lambda: open(os.path.join(os.path.dirname(real), 'secret.txt')).read())
out['beside'] = sorted(os.listdir(os.path.dirname(real)))
print(json.dumps(out))
"""


@pytest.fixture
def jail(tmp_path: Path) -> Jail:
    return Jail(tmp_path)


def source_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A footage root with one video every user may read and write (so that only the mount
    stops a write), and a file beside it that the job was not given."""
    root = tmp_path / "footage"
    root.mkdir()
    video = root / "cam1.mp4"
    video.write_bytes(VIDEO)
    video.chmod(0o666)
    (root / "secret.txt").write_text("not an input")
    return root, video


def probe(jail: Jail, root: Path, *, sandboxed: bool) -> dict[str, Any]:
    p = jail.plan(command=python(PROBE))
    p.input_dir.mkdir(parents=True)
    bound = link_local_file(str(root / "cam1.mp4"), p.input_dir / "m00.mp4", (str(root),),
                            protected_paths(jail.settings))
    assert bound is not None
    p = dataclasses.replace(p, input_binds=(bound,))
    outcome = jail.run(p, sandboxed=sandboxed)
    said = p.log_path.read_text()
    assert outcome.reason.value == "succeeded", said
    return dict(json.loads(said.strip().splitlines()[-1]))


def test_a_bound_source_is_read_whole_but_neither_written_nor_seen_beside(
        jail: Jail, tmp_path: Path) -> None:
    # Given a local video staged as a link, bound read-only into the job's sandbox
    root, video = source_dir(tmp_path)

    # When the job reads it, then tries to write it, chmod it and look beside it
    seen = probe(jail, root, sandboxed=True)

    # Then it read every byte, and its writes were refused by the read-only mount
    assert seen["read"] == len(VIDEO)
    assert seen["write"] == "EROFS" and seen["chmod"] in ("EROFS", "EPERM")
    # And nothing of the source's directory but the bound file exists for it
    assert seen["sibling"] == "ENOENT" and seen["beside"] == ["cam1.mp4"]
    assert video.read_bytes() == VIDEO and stat.S_IMODE(video.stat().st_mode) == 0o666


def test_without_the_sandbox_the_same_link_would_let_the_job_write_the_source(
        jail: Jail, tmp_path: Path) -> None:
    # Given the same link, but the job run without a sandbox (the protection off)
    root, video = source_dir(tmp_path)

    # When the same job runs
    seen = probe(jail, root, sandboxed=False)

    # Then it wrote the source and saw beside it: why a worker without a sandbox copies
    assert seen["write"] == "done" and "secret.txt" in seen["beside"]
    assert video.read_bytes() != VIDEO


def stage(tmp_path: Path, jail: Jail, video: Path, *, sandbox: object) -> tuple[
        tuple[Path, ...], Path]:
    settings = jail.settings.model_copy(update={"input_file_roots": (str(video.parent),)})
    svc: Any = SimpleNamespace(settings=settings, sandbox=sandbox)
    p = jail.plan(command=["true"], inputs={"m00.mp4": f"file://{video}"})
    claim = Claim(job_id=p.job_id, tenant_id=TENANT, token=1, attempt=1, spec=p.spec, gpus=0)
    return stage_inputs(svc, claim, p), p.input_dir / "m00.mp4"


def test_a_chunk_stages_no_byte_of_a_readable_local_video_in_a_sandbox_and_copies_otherwise(
        jail: Jail, tmp_path: Path) -> None:
    # Given a local video every user may read, and one only its owner may
    root, video = source_dir(tmp_path)
    private = root / "private.mp4"
    private.write_bytes(VIDEO)
    private.chmod(0o600)

    # When a sandboxed worker stages the readable one: a link, bound; no byte copied
    binds, staged = stage(tmp_path, jail, video, sandbox=jail.sandbox)
    assert binds == (Path(os.path.realpath(video)),) and staged.is_symlink()
    assert copied_bytes(staged) == 0

    # And a worker without a sandbox, or a file the job's uid could not read: a copy
    for source, sandbox in ((video, None), (private, jail.sandbox)):
        jail_root = jail.plan(command=["true"]).root
        shutil.rmtree(jail_root.parent)
        binds, staged = stage(tmp_path, jail, source, sandbox=sandbox)
        assert binds == () and not staged.is_symlink()
        assert copied_bytes(staged) == len(VIDEO)
