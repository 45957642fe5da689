"""A job's own environment without uv: the spec's `python` field, the cache key, what a
resolution installs over the worker, and the cache's build-once, hold and evict rules (with a
stand-in build, on real files)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from e31.core.errors import SetupError, SpecError
from e31.core.pythonenv import PythonEnv
from e31.core.spec import JobSpec
from e31.edge.settings import Settings
from e31_worker.attempt.envcache import RECORD, EnvCache
from e31_worker.attempt.environment import (
    BaseEnv,
    EnvRequest,
    UvBuild,
    cache_key,
    job_environment,
    to_install,
)
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.watchdog import SetupStopped
from tests.conftest import process_alive

CODE = "sha256:" + "a" * 64
BASE = BaseEnv(executable="/opt/py/bin/python", site_dirs=("/opt/py/site-packages",),
               system_site=True, distributions={"torch": "2.13.0+cpu", "numpy": "2.4.6"})


def spec_errors(python: Any, **fields: Any) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as refused:
        JobSpec.parse({"command": ["python", "x.py"], "python": python, **fields})
    return refused.value.errors


# -- the spec ---------------------------------------------------------------------------------

def test_a_spec_takes_pip_requirements_and_a_requirements_file_of_its_code() -> None:
    spec = JobSpec.parse({"command": ["python", "x.py"], "code": CODE,
                          "python": {"pip": ["tomli-w==1.2.0", "pkg[extra]>=1; python_version>'3'"],
                                     "requirements": "sub/requirements.txt"}})
    assert spec.python == PythonEnv(pip=["tomli-w==1.2.0", "pkg[extra]>=1; python_version>'3'"],
                                    requirements="sub/requirements.txt")


def test_a_bad_pip_requirement_is_refused_naming_its_index() -> None:
    [error] = spec_errors({"pip": ["tomli-w", "not a requirement!"]})
    assert error["field"] == "python.pip[1]"
    assert "'not a requirement!' is not a requirement" in error["reason"]


def test_an_option_is_no_requirement() -> None:
    [error] = spec_errors({"pip": ["--index-url=https://evil.example/simple"]})
    assert error["field"] == "python.pip[0]"


def test_the_number_of_pip_requirements_is_capped() -> None:
    [error] = spec_errors({"pip": [f"pkg{i}" for i in range(65)]})
    assert error["field"] == "python.pip" and "at most 64" in error["reason"]


def test_a_requirements_file_needs_the_jobs_code() -> None:
    [error] = spec_errors({"requirements": "requirements.txt"})
    assert error["field"] == "python.requirements"
    assert "code" in error["reason"]


@pytest.mark.parametrize("path", ["/etc/requirements.txt", "../requirements.txt",
                                  "a/../../r.txt", ""])
def test_a_requirements_file_outside_the_code_is_refused(path: str) -> None:
    [error] = spec_errors({"requirements": path}, code=CODE)
    assert error["field"] == "python.requirements"


def test_unknown_python_fields_and_lax_types_are_refused() -> None:
    assert spec_errors({"conda": ["x"]})[0]["field"] == "python.conda"
    assert spec_errors({"pip": "tomli-w"})[0]["field"] == "python.pip"


# -- the cache key ----------------------------------------------------------------------------

def request(*pip: str, requirements: str | None = None) -> EnvRequest:
    return EnvRequest(pip=tuple(pip), requirements=requirements)


def test_the_same_request_spelled_otherwise_has_the_same_key() -> None:
    a = EnvRequest.of(PythonEnv(pip=["Tomli_W == 1.2.0", "six"]), None)
    b = EnvRequest.of(PythonEnv(pip=["six", "tomli-w==1.2.0", "six"]), None)
    assert a == b and cache_key(a, BASE) == cache_key(b, BASE)


def test_the_key_changes_with_what_is_asked_and_with_the_base() -> None:
    key = cache_key(request("six"), BASE)
    assert cache_key(request("six==1.17.0"), BASE) != key
    assert cache_key(request("six", requirements="tomli-w\n"), BASE) != key
    assert cache_key(request("six", requirements="tomli-w==1.2.0\n"), BASE) != \
        cache_key(request("six", requirements="tomli-w\n"), BASE)
    upgraded = BaseEnv(BASE.executable, BASE.site_dirs, BASE.system_site,
                       {**BASE.distributions, "numpy": "2.4.7"})
    assert cache_key(request("six"), upgraded) != key
    moved = BaseEnv("/other/bin/python", BASE.site_dirs, BASE.system_site, BASE.distributions)
    assert cache_key(request("six"), moved) != key


def test_the_worker_is_pinned_at_its_public_versions() -> None:
    assert BASE.constraints() == {"torch": "2.13.0", "numpy": "2.4.6"}


def test_the_current_base_is_this_interpreter_with_its_distributions() -> None:
    base = BaseEnv.current()
    assert base.executable and base.distributions.get("pydantic")
    assert base.fingerprint == BaseEnv.current().fingerprint


# -- what a resolution installs ---------------------------------------------------------------

RESOLVED = """--index-url https://pypi.org/simple

cuda-toolkit==13.0.3.0    # via torch
humanize==4.17.0          # via -r request.in
numpy==2.4.6              # via torchvision, -c constraints.txt
nvidia-cublas==13.1.1.3   # via cuda-toolkit
pillow==13.0.0            # via torchvision
olefile==0.47             # via pillow
tomli-w==1.2.0            # via -r requirements.txt
torch==2.13.0             # via torchvision, -c constraints.txt
torchvision==0.28.0       # via -r request.in
"""


def test_only_what_the_worker_lacks_and_the_request_needs_is_installed() -> None:
    # torch is the worker's: neither it nor what only torch needs (CUDA wheels) is installed;
    # pillow comes through torchvision, which the worker lacks, and olefile through pillow
    assert to_install(RESOLVED, BASE.constraints()) == [
        "--index-url https://pypi.org/simple", "humanize==4.17.0", "olefile==0.47",
        "pillow==13.0.0", "tomli-w==1.2.0", "torchvision==0.28.0"]


def test_a_request_the_worker_satisfies_installs_nothing() -> None:
    resolved = "numpy==2.4.6              # via -c constraints.txt, -r request.in\n"
    assert to_install(resolved, BASE.constraints()) == []


# -- the requirements file --------------------------------------------------------------------

def test_the_requirements_file_is_read_from_the_jobs_code(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "requirements.txt").write_text("tomli-w==1.2.0\n")
    got = EnvRequest.of(PythonEnv(requirements="sub/requirements.txt"), tmp_path)
    assert got.requirements == "tomli-w==1.2.0\n"


def test_a_requirements_file_missing_or_linked_out_of_the_code_is_a_setup_error(
        tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (tmp_path / "secret.txt").write_text("x\n")
    (code / "out.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(SetupError, match="not in the job's code"):
        EnvRequest.of(PythonEnv(requirements="requirements.txt"), code)
    with pytest.raises(SetupError, match="not a file of the job's code"):
        EnvRequest.of(PythonEnv(requirements="out.txt"), code)
    with pytest.raises(SetupError, match="has no code"):
        EnvRequest.of(PythonEnv(requirements="requirements.txt"), None)


# -- the cache (a stand-in build: a directory with one file of `size` bytes) -------------------

class CountingBuild:
    def __init__(self, size: int = 4096, delay_s: float = 0.0, fail: bool = False) -> None:
        self.size, self.delay_s, self.fail, self.calls = size, delay_s, fail, 0

    def __call__(self, scratch: Path) -> dict[str, Any]:
        self.calls += 1
        time.sleep(self.delay_s)
        (scratch / "env").mkdir()
        (scratch / "env" / "blob").write_bytes(b"x" * self.size)
        if self.fail:
            raise SetupError("cannot install")
        return {"installed": ["pkg==1"]}


def never_beats() -> None:
    raise AssertionError("nothing should wait here")


def test_an_environment_is_built_once_and_then_reused(tmp_path: Path) -> None:
    cache = EnvCache(tmp_path, max_bytes=10 ** 9, beat_s=0.05)
    build = CountingBuild()

    first = cache.acquire("k1", build, beat=never_beats)
    first.release()
    second = cache.acquire("k1", build, beat=never_beats)
    second.release()

    assert (first.built, second.built, build.calls) == (True, False, 1)
    record = json.loads((tmp_path / "k1" / RECORD).read_text())
    assert record["installed"] == ["pkg==1"] and record["size_bytes"] >= 4096
    assert second.record == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1", "k1.lock"]


def test_two_processes_asking_at_once_build_once(tmp_path: Path) -> None:
    cache = EnvCache(tmp_path, max_bytes=10 ** 9, beat_s=0.05)
    build = CountingBuild(delay_s=0.5)
    beats: list[float] = []
    got: list[bool] = []

    def ask() -> None:
        env = cache.acquire("k1", build, beat=lambda: beats.append(time.monotonic()))
        got.append(env.built)
        env.release()

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert build.calls == 1 and sorted(got) == [False, True]
    assert beats, "the one that waited kept its lease beating"


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    cache = EnvCache(tmp_path, max_bytes=10 ** 9, beat_s=0.05)
    with pytest.raises(SetupError):
        cache.acquire("k1", CountingBuild(fail=True), beat=never_beats)
    assert [p.name for p in tmp_path.iterdir()] == ["k1.lock"]
    # and the lock was let go: the next job builds
    env = cache.acquire("k1", CountingBuild(), beat=never_beats)
    assert env.built
    env.release()


def test_the_least_recently_used_environment_no_job_holds_is_evicted(tmp_path: Path) -> None:
    # Given room for three environments, one of them in use
    held = EnvCache(tmp_path, max_bytes=10 ** 9, beat_s=0.05).acquire(
        "old-held", CountingBuild(8192), beat=never_beats)
    cache = EnvCache(tmp_path, max_bytes=3 * held.record["size_bytes"], beat_s=0.05)
    cache.acquire("old", CountingBuild(8192), beat=never_beats).release()
    cache.acquire("recent", CountingBuild(8192), beat=never_beats).release()
    past = time.time() - 3600
    for key in ("old-held", "old"):
        os.utime(tmp_path / key, (past, past))

    # When a fourth build passes the bound
    cache.acquire("new", CountingBuild(8192), beat=never_beats).release()

    # Then the oldest unused one went; the one in use stayed, however old
    present = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert present == ["new", "old-held", "recent"]
    held.release()


def test_a_dead_builds_leftovers_are_cleared(tmp_path: Path) -> None:
    (tmp_path / ".build-k9-abc123" / "env").mkdir(parents=True)
    cache = EnvCache(tmp_path, max_bytes=10 ** 9, beat_s=0.05)
    assert cache.evict() == []
    assert not (tmp_path / ".build-k9-abc123").exists()


def test_a_job_that_asks_for_nothing_runs_in_the_workers_environment(tmp_path: Path) -> None:
    for python in (None, {"pip": []}):
        spec = JobSpec.parse({"command": ["python", "x.py"], "python": python})
        plan = AttemptPlan(job_id="j-test", attempt=1, spec=spec, gpus="", root=tmp_path,
                           kill_grace_s=1, log_max_bytes=1024, tick_interval_s=1)
        assert job_environment(Settings(home=tmp_path), plan, beat=never_beats) is None
    assert not (tmp_path / "work" / ".envs").exists()


# -- a build that is stopped, or takes too long (a stand-in uv that hangs) ---------------------

def hanging_uv(tmp_path: Path) -> tuple[Path, Path]:
    """A `uv` that records its pid and then hangs; and the pid file."""
    pidfile = tmp_path / "uv.pid"
    uv = tmp_path / "uv"
    uv.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec sleep 60\n")
    uv.chmod(0o755)
    return uv, pidfile


def hung_build(tmp_path: Path, uv: Path, beat: Any, timeout_s: float = 60) -> UvBuild:
    return UvBuild(EnvRequest(pip=("tomli-w",)), BASE, uv=str(uv), log_path=tmp_path / "log",
                   beat=beat, beat_s=0.05, timeout_s=timeout_s)


def test_a_cancel_while_the_environment_builds_stops_uv(tmp_path: Path) -> None:
    uv, pidfile = hanging_uv(tmp_path)

    def cancelled() -> None:
        if pidfile.exists():
            raise SetupStopped(Directive.CANCEL)

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(SetupStopped) as stopped:
        hung_build(tmp_path, uv, cancelled)(scratch)
    assert stopped.value.directive is Directive.CANCEL
    assert not process_alive(int(pidfile.read_text()))


def test_a_build_past_env_build_timeout_s_is_a_setup_error(tmp_path: Path) -> None:
    uv, pidfile = hanging_uv(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(SetupError, match="env_build_timeout_s"):
        hung_build(tmp_path, uv, lambda: None, timeout_s=0.3)(scratch)
    assert not process_alive(int(pidfile.read_text()))
