"""The job process of a warm attempt: it becomes what a fresh `python -m
e31_worker.child.runner JOB_JSON` would be, then runs the job and ends without the teardown.

`enter_job` gives it its session and uid (when sandboxed), no new privileges, death with its
parent, signal handlers and mask as a fresh Python's, the job's directory and exactly the cold
path's environment, and a fresh Python's `sys.path`, argv, stdio and seeds; `run_job` then calls
`runner.main`, which writes `S<monotonic time>` to the status pipe and closes it right before
the entrypoint is imported (the worker's start latency). Any failure before the job's code is
`fail`: said in the log, exit `EXIT_SETUP`, and the worker starts the attempt cold.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

from e31_worker.child import runner
from e31_worker.child.linuxcalls import (
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    prctl,
)

EXIT_SETUP = 125               # the warm child failed before any job code ran

_base_path: list[str] = []     # sys.path without the zygote's cwd and PYTHONPATH entries


@dataclass
class Job:
    """What the forked job process runs once it is in its sandbox."""

    job_file: str
    status_fd: int


def remember_base_path() -> None:
    """Keep, in the warm process before it forks, the `sys.path` a job starts from."""
    _base_path[:] = _python_base_path()


def _python_base_path() -> list[str]:
    """sys.path as a fresh `python -m` of this interpreter has it without PYTHONPATH."""
    extra = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p}
    return [p for p in sys.path[1:] if os.path.realpath(p) not in extra]


def enter_job(request: dict[str, Any], status_fd: int, *, sandboxed: bool) -> Job:
    """The job process: its session, uid, signals, directory, environment and Python."""
    try:
        if sandboxed:
            os.setsid()
            uid = int(request["sandbox"]["uid"])
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            prctl(PR_SET_DUMPABLE, 1)   # its own /proc/self, as after an exec
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        _fresh_signals()
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        _fresh_python(request["cwd"], env, request["job_file"])
    except BaseException:  # noqa: BLE001
        fail()
    return Job(job_file=request["job_file"], status_fd=status_fd)


def fail() -> NoReturn:
    """Say what failed in the log (the worker shows it and starts the attempt cold) and end."""
    try:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(EXIT_SETUP)


def run_job(job: Job) -> NoReturn:
    """Run the job as `python -m e31_worker.child.runner JOB_JSON` would, and end it as a
    forked worker of multiprocessing ends: what a job can rely on at exit happens (its
    non-daemon threads are joined, atexit functions run, its open files and stdio flushed),
    but not the interpreter's teardown of every module, which in a fork of a process holding
    torch writes to (copies) most of its memory and costs seconds."""
    def user_code_next() -> None:
        os.write(job.status_fd, f"S{_monotonic()}\n".encode())
        os.close(job.status_fd)

    try:
        code = runner.main([job.job_file], on_user_code=user_code_next)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - as Python itself reports an uncaught one
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Python's exit does first
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = code or 1
    for obj in gc.get_objects():   # the job's own objects only: the zygote's are frozen
        if isinstance(obj, io.IOBase):
            try:
                obj.flush()
            except Exception:  # noqa: BLE001 - closed, or not writable
                continue
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            continue
    os._exit(code)


def _exit_status(code: object) -> int:
    """The exit status Python gives `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _monotonic() -> float:
    import time
    return time.monotonic()


def _fresh_signals() -> None:
    """Dispositions and mask as a new Python has them."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _fresh_python(cwd: str, env: dict[str, str], job_file: str) -> None:
    """sys.path, argv, stdio and the seeds as a fresh `python -m ...runner` would have."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *_base_path]
    importlib.invalidate_caches()   # the finders of the zygote's entries re-read their dirs
    sys.argv = [runner.__file__, job_file]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    numpy = sys.modules.get("numpy")
    if numpy is not None:   # a fork shares the zygote's seed; a cold start draws its own
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
