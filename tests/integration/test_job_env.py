"""What a job inherits of its worker's environment (e31_worker.attempt.jobenv): the allowlist,
the operator's `job_env_passthrough`, the spec's `env`, never a credential of the worker's.

Real child processes through the Supervisor, cold (a command job and an entrypoint job) and
warm (an entrypoint job forked from a real warm process): each runs once with the filter on,
and once with it switched off (`job_env_passthrough = "*"`, the behaviour before it), which
must show the very same credential, so the test cannot pass because the job never had it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, Start
from e31_worker.attempt.jobenv import inherited_env
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.supervisor import Supervisor
from e31_worker.attempt.warm import WarmStarter, warm_env

SECRET = "aws-secret-of-the-worker-host"
WORKER_ENV = {
    "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ACCESS_KEY_ID": "AKIAWORKER",
    "GOOGLE_APPLICATION_CREDENTIALS": "/etc/gcp/worker.json", "PGPASSWORD": "pg-secret",
    "AZURE_CLIENT_SECRET": "az-secret", "HF_HOME": "/srv/hf", "LC_ALL": "C.UTF-8",
    "E31_DATABASE_URL": "postgresql://e31:store-secret@db/e31",
}
PASSTHROUGH = ("HF_*",)
ENVJOB = "import os\n\ndef env(ctx):\n    return dict(os.environ)\n"
READY_S = 180.0


@pytest.fixture(scope="module")
def worker_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The worker's environment holding credentials, and a job module on its PYTHONPATH."""
    jobs = tmp_path_factory.mktemp("envjobs")
    jobs.chmod(0o755)
    (jobs / "envjob.py").write_text(ENVJOB)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in WORKER_ENV.items():
            mp.setenv(k, v)
        mp.setenv("PYTHONPATH", str(jobs), prepend=os.pathsep)
        yield jobs


@pytest.fixture(scope="module")
def warm(worker_env: Path) -> Iterator[WarmStarter]:
    """A warm process started as the worker starts it (celery_process), with the operator's
    passthrough."""
    w = WarmStarter(env=warm_env(os.environ, PASSTHROUGH))
    w.start()
    assert w.wait_ready(READY_S), "the warm process did not start"
    yield w
    w.close()


def _run(tmp_path: Path, how: str, passthrough: tuple[str, ...],
         warm: WarmStarter | None) -> dict[str, str]:
    """The environment a job saw, started `how` (command, entrypoint: cold; warm)."""
    spec: dict[str, Any] = {"env": {"MY_SETTING": "from-the-spec"}, "timeout_s": 120}
    if how == "command":
        spec["command"] = ["python3", "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    else:
        spec["entrypoint"] = "envjob:env"
    p = AttemptPlan(job_id="j-env", attempt=1, spec=JobSpec.parse(spec), gpus="",
                    root=tmp_path / how / "attempt-1", kill_grace_s=1.0, log_max_bytes=1 << 20,
                    tick_interval_s=0.1, env_passthrough=passthrough)
    starts: list[Start] = []
    result = Supervisor(p, tick=lambda _: Directive.CONTINUE, warm=warm,
                        on_start=lambda ms, start: starts.append(start)).run()
    assert result.reason is AttemptReason.SUCCEEDED, (result, p.log_path.read_text())
    if how == "warm":
        assert starts == [Start.WARM]
    if how == "command":
        seen: dict[str, str] = json.loads(p.log_path.read_text().strip().splitlines()[-1])
        return seen
    assert isinstance(result.result, dict)
    return result.result


@pytest.mark.parametrize("how", ["command", "entrypoint", "warm"])
def test_a_job_sees_no_credential_of_its_worker_but_its_spec_and_passthrough(
        how: str, worker_env: Path, warm: WarmStarter, tmp_path: Path) -> None:
    starter = warm if how == "warm" else None

    # When a job runs on a worker whose environment holds cloud and database credentials
    seen = _run(tmp_path, how, PASSTHROUGH, starter)

    # Then it sees none of them, nor the worker's E31_* settings
    assert SECRET not in json.dumps(seen)
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS",
                 "PGPASSWORD", "AZURE_CLIENT_SECRET", "E31_DATABASE_URL"):
        assert name not in seen, name
    # But what its spec set, what the operator passes through, the allowlist and E31's own
    assert seen["MY_SETTING"] == "from-the-spec"
    assert seen["HF_HOME"] == "/srv/hf" and seen["LC_ALL"] == "C.UTF-8"
    assert seen["PATH"] and seen["E31_JOB_ID"] == "j-env"

    # And with the filter switched off (passthrough "*"), the same job sees the credential:
    # the worker's environment did hold it
    off = _run(tmp_path / "off", how, ("*",), starter)
    assert off["AWS_SECRET_ACCESS_KEY"] == SECRET and off["PGPASSWORD"] == "pg-secret"
    assert "E31_DATABASE_URL" not in off   # the worker's own settings: never, even then


def test_the_warm_process_itself_holds_no_credential(warm: WarmStarter) -> None:
    # The memory every warm job is forked from: /proc/<zygote>/environ is its initial block
    assert warm.pid is not None
    environ = Path(f"/proc/{warm.pid}/environ").read_bytes()
    assert SECRET.encode() not in environ and b"pg-secret" not in environ
    assert b"HF_HOME=/srv/hf" in environ
    # while the worker's environment it was built from holds them (the filter did this)
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET
    assert warm_env(os.environ, ("*",))["AWS_SECRET_ACCESS_KEY"] == SECRET


def test_the_allowlist_keeps_the_systems_and_the_drivers_variables() -> None:
    environ = {"PATH": "/bin", "LANG": "C", "LC_CTYPE": "C", "TZ": "UTC", "TERM": "xterm",
               "HTTPS_PROXY": "http://proxy:3128", "no_proxy": "localhost",
               "NVIDIA_DRIVER_CAPABILITIES": "compute", "CUDA_HOME": "/usr/local/cuda",
               "NCCL_SOCKET_IFNAME": "eth0", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
               "AWS_SESSION_TOKEN": "t", "AWS_PROFILE": "prod",
               "AWS_SHARED_CREDENTIALS_FILE": "/root/.aws/credentials", "PGPASSFILE": "/p",
               "REDIS_URL": "redis://:pw@r", "DATABASE_URL": "postgresql://u:pw@h/db",
               "AZURE_STORAGE_KEY": "k", "E31_REDIS_URL": "redis://:pw@r"}
    kept = inherited_env(environ)
    assert set(kept) == {"PATH", "LANG", "LC_CTYPE", "TZ", "TERM", "HTTPS_PROXY", "no_proxy",
                         "NVIDIA_DRIVER_CAPABILITIES", "CUDA_HOME", "NCCL_SOCKET_IFNAME",
                         "LD_LIBRARY_PATH"}
    assert inherited_env(environ, ["AWS_PROFILE", "AZURE_*"]) == {
        **kept, "AWS_PROFILE": "prod", "AZURE_STORAGE_KEY": "k"}
    assert "E31_REDIS_URL" not in inherited_env(environ, ["*"])


def test_a_worker_found_on_its_pythonpath_passes_its_sandbox_check(tmp_path: Path) -> None:
    # A worker run from a checkout (its packages on PYTHONPATH, not installed): the sandbox's
    # start check runs `import e31_worker.child.runner` as a job would, with a job's
    # environment; with PATH alone (as it was) it found no e31_worker and the worker refused
    # to start
    if os.geteuid() != 0 or not shutil.which("bwrap"):
        pytest.skip("the sandbox needs root and bubblewrap")
    import e31
    import e31_worker
    checkout = tmp_path / "checkout"
    for package in (e31, e31_worker):
        src = Path(package.__file__).parent
        shutil.copytree(src, checkout / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    checkout.chmod(0o755)
    probe = ("import sys, tempfile; from pathlib import Path; import e31_worker; "
             "assert e31_worker.__file__.startswith(sys.argv[1]), e31_worker.__file__; "
             "from e31.edge.settings import Settings; "
             "from e31_worker.attempt.sandbox import sandbox_unavailable; "
             "print(sandbox_unavailable(Settings(redis_url='redis://unused', "
             "home=Path(sys.argv[2]))))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env["PYTHONPATH"] = str(checkout)
    done = subprocess.run([sys.executable, "-c", probe, str(checkout), str(tmp_path / "home")],
                          env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None", done.stdout
