"""What a job inherits of its worker's environment: an allowlist (docs/security.md, "What a
job's environment holds").

A worker's environment may hold the credentials of its host (AWS_*, GOOGLE_APPLICATION_CREDENTIALS,
AZURE_*, PGPASSWORD, ...), which are no tenant's business. A job therefore inherits only the
variables named here (the system's: paths, locale, terminal, proxies and CA bundles, Python's own,
and the GPU driver's NVIDIA_*, CUDA_*, NCCL_*), plus those an operator adds with the setting
`job_env_passthrough` (names or shell globs; `*` inherits everything, the behaviour before this
allowlist). A worker's own `E31_*` settings never pass, whatever the passthrough says. What a
job needs beyond this, its spec sets in `env:` (or `secrets:`).

Both starts use it: the supervisor's environment for an attempt (cold and warm alike,
`ChildStart.env` in `e31_worker.attempt.start`) and the warm process's own
(`e31_worker.attempt.warm.warm_env`), whose memory every warm job is forked from.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Mapping

# Names and globs (fnmatchcase) a job inherits from its worker by default.
INHERITED: tuple[str, ...] = (
    # the system: where programs are, who and where the job is (the sandbox replaces HOME,
    # USER and LOGNAME with the job's own), its locale, terminal and temporary directory
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM",
    "TMPDIR", "LD_LIBRARY_PATH",
    # Python's own settings (the job's runner is the worker's package, found on PYTHONPATH)
    "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "PYTHONUTF8",
    "PYTHONHASHSEED", "PYTHONWARNINGS", "VIRTUAL_ENV",
    # the network's way out: proxies (either case) and the CA certificates to trust
    "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    # the GPU driver and its libraries (CUDA_VISIBLE_DEVICES is set per attempt anyway)
    "NVIDIA_*", "CUDA_*", "NCCL_*", "OMP_NUM_THREADS",
)

WORKER_ONLY = "E31_"   # the worker's own settings: never a job's, not even through "*"


def inherited_env(environ: Mapping[str, str],
                  passthrough: Iterable[str] = ()) -> dict[str, str]:
    """The variables of `environ` a job inherits: those `INHERITED` or the operator's
    `passthrough` (settings `job_env_passthrough`) names, never an `E31_*` one."""
    patterns = (*INHERITED, *passthrough)
    return {k: v for k, v in environ.items() if _inherits(k, patterns)}


@functools.lru_cache(maxsize=4096)
def _inherits(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a variable `name` passes: decided once per name (every attempt's start asked
    each pattern of each of the worker's variables again, issue 31)."""
    return not name.startswith(WORKER_ONLY) and any(fnmatch.fnmatchcase(name, p)
                                                    for p in patterns)
