"""The sandbox's rules that need no bubblewrap: a tenant's uid, what no job may see, exit
statuses, how the worker reads a job's files, and heartbeats that say how jobs run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from e31.core.errors import ConfigError
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo
from e31_worker.attempt.binds import protected_paths
from e31_worker.attempt.sandbox import Sandbox, exit_code, read_job_file


def settings(tmp_path: Path, **values: object) -> Settings:
    return Settings.load({"home": str(tmp_path / "home"), **values}, environ={})


def test_a_tenants_uid_is_stable_inside_the_range_and_differs_between_tenants(
        tmp_path: Path) -> None:
    # Given a range of 1000 uids from 300000
    sandbox = Sandbox.from_settings(settings(tmp_path, sandbox_uid_base=300_000,
                                             sandbox_uid_count=1000))

    # Then each tenant has one uid in it, the same every time, and two tenants two
    uids = {t: sandbox.uid_for(t) for t in ("t-aaaaaaaaaaaa", "t-bbbbbbbbbbbb")}
    assert all(300_000 <= u < 301_000 for u in uids.values())
    assert uids == {t: sandbox.uid_for(t) for t in uids}
    assert len(set(uids.values())) == 2


def test_no_job_may_see_the_home_the_work_dir_the_store_the_artifacts_or_the_password(
        tmp_path: Path) -> None:
    secret = tmp_path / "redis.password"
    s = settings(tmp_path, work_dir=str(tmp_path / "scratch"),
                 database_url=f"sqlite:///{tmp_path / 'db' / 'e31.db'}",
                 artifacts_url=f"file://{tmp_path / 'artifacts'}", redis_password_file=str(secret))
    hidden = set(protected_paths(s))
    real = Path(os.path.realpath(tmp_path))
    assert {real / "home", real / "scratch", real / "db" / "e31.db", real / "artifacts",
            real / "redis.password"} <= hidden


def test_an_operators_shared_directory_that_would_show_a_protected_path_is_refused(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds"):
        Sandbox.from_settings(settings(tmp_path, sandbox_read_only_dirs=(str(tmp_path),)))
    with pytest.raises(ConfigError, match="is inside"):
        Sandbox.from_settings(settings(
            tmp_path, sandbox_writable_dirs=(str(tmp_path / "home" / "work"),)))
    Sandbox.from_settings(settings(tmp_path, sandbox_read_only_dirs=(str(tmp_path / "data"),)))


def test_bubblewraps_exit_status_of_a_killed_job_reads_as_the_signal() -> None:
    assert exit_code(128 + signal.SIGKILL) == -signal.SIGKILL
    assert exit_code(128 + signal.SIGTERM) == -signal.SIGTERM
    assert exit_code(-signal.SIGKILL) == -signal.SIGKILL   # bubblewrap itself killed
    assert (exit_code(0), exit_code(3), exit_code(128)) == (0, 3, 128)


def test_the_worker_reads_a_jobs_file_only_when_it_is_a_regular_file(tmp_path: Path) -> None:
    # Given a result file, a link to a file the job could not read, and a FIFO
    (tmp_path / "result.json").write_text('{"result": 1}')
    (tmp_path / "secret.json").write_text('{"result": "secret"}')
    (tmp_path / "link.json").symlink_to(tmp_path / "secret.json")
    os.mkfifo(tmp_path / "fifo.json")

    # Then only the regular file is read; the link and the FIFO (which would block) are not
    assert json.loads(read_job_file(tmp_path / "result.json") or b"") == {"result": 1}
    assert read_job_file(tmp_path / "link.json") is None
    assert read_job_file(tmp_path / "fifo.json") is None
    assert read_job_file(tmp_path / "absent.json") is None
    with pytest.raises(ValueError, match="larger than 4 bytes"):
        read_job_file(tmp_path / "result.json", max_bytes=4)


def test_a_heartbeat_says_how_its_workers_jobs_run_and_an_older_one_still_parses() -> None:
    info = WorkerInfo(node="gpu0@h", queues=("e31.gpu24",), gpus="0", gpu_count=1,
                      size_class="gpu24", isolation="sandbox")
    assert WorkerInfo.from_json(info.to_json()).isolation == "sandbox"
    older = json.dumps({"node": "gpu0@h", "queues": ["e31.gpu24"], "gpus": "0"})
    assert WorkerInfo.from_json(older).isolation == ""
