"""The version check at the call (`e31.functions.versions`): what refuses a call, naming the
package, what leaves it to the worker, and the one question per `CACHE_S`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from e31 import Client
from e31.core.errors import FunctionError
from e31.core.functioncalls import environment, environment_digest
from e31.functions import versions

CALLER = {"python": "3.11", "packages": {"fakepkg": "9.9", "numpy": "2.1.0", "gone": None}}


def _answer(*envs: dict[str, Any], unknown: int = 0) -> dict[str, Any]:
    return {"size_class": "cpu", "queue": "e31.cpu", "workers": len(envs) + unknown,
            "unknown": unknown, "environments": [dict(e, digest="d", workers=1) for e in envs]}


def test_a_call_every_live_environment_lacks_a_package_of_is_refused_naming_it() -> None:
    lacking = {"python": "3.11", "packages": {"numpy": "2.1.0"}}
    why = versions.refusal(_answer(lacking), CALLER)
    assert why is not None
    assert "package fakepkg 9.9 on the caller's side, not installed on the worker" in why
    assert "class cpu" in why and "nothing was stored" in why
    assert "numpy" not in why and "gone" not in why    # what agrees, or the caller lacks too


def test_another_version_or_python_is_named_on_the_nearest_environment() -> None:
    older = {"python": "3.11", "packages": {"fakepkg": "1.0", "numpy": "2.1.0"}}
    other_python = {"python": "3.12", "packages": {"numpy": "1.0"}}
    why = versions.refusal(_answer(other_python, older), CALLER)
    assert why is not None
    assert "package fakepkg 9.9 on the caller's side, 1.0 on the worker" in why
    assert "nearest of its 2 environments" in why and "3.12" not in why


@pytest.mark.parametrize("answer", [
    _answer({"python": "3.11", "packages": {"fakepkg": "9.9", "numpy": "2.1.0"}},
            {"python": "3.12", "packages": {}}),                  # one of them agrees
    _answer(),                                                    # no live worker
    _answer({"python": "3.12", "packages": {}}, unknown=1),       # one that cannot be told
])
def test_a_call_one_worker_may_run_or_that_cannot_be_told_is_left_to_the_worker(
        answer: dict[str, Any]) -> None:
    assert versions.refusal(answer, CALLER) is None


def test_the_environment_is_every_installed_distribution_and_its_digest_is_canonical() -> None:
    env = environment()
    assert env["packages"]["cloudpickle"] and env["python"].count(".") == 1
    reordered = {"modules": env["modules"], "python": env["python"],
                 "packages": dict(reversed(env["packages"].items()))}
    assert environment_digest(reordered) == environment_digest(env)
    assert environment_digest({**env, "python": "2.7"}) != environment_digest(env)


class FakeApi:
    """Answers the environments route (or 404, an older API), counting the questions."""

    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.answer = answer
        self.asked: list[dict[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(dict(request.url.params))
        if self.answer is None:
            return httpx.Response(404, json={"message": "not found"})
        return httpx.Response(200, json=self.answer)


def _client(api: FakeApi, url: str) -> Client:
    client = Client(url, "token")
    client._http = httpx.Client(base_url=url, transport=httpx.MockTransport(api))
    return client


def test_check_asks_once_per_cache_time_and_refuses_with_a_function_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(_answer({"python": "3.11", "packages": {}}))
    client = _client(api, "http://check.invalid")
    spec = {"resources": {"gpus": 1, "gpu_mem_gb": 40, "mem_gb": 8}}
    for _ in range(3):
        with pytest.raises(FunctionError, match="package fakepkg 9.9"):
            versions.check(client, spec, CALLER)
    assert api.asked == [{"gpus": "1", "gpu_mem_gb": "40"}]
    monkeypatch.setattr(versions, "CACHE_S", 0.0)
    with pytest.raises(FunctionError):
        versions.check(client, spec, CALLER)
    assert len(api.asked) == 2


def test_check_is_skipped_for_an_older_api_and_a_job_building_its_own_environment() -> None:
    older = FakeApi(None)
    versions.check(_client(older, "http://older.invalid"), {"resources": {}}, CALLER)
    assert len(older.asked) == 1
    refusing = FakeApi(_answer({"python": "3.11", "packages": {}}))
    versions.check(_client(refusing, "http://own-env.invalid"),
                   {"resources": {}, "python": {"pip": ["fakepkg==9.9"]}}, CALLER)
    assert refusing.asked == []


def test_a_package_spelled_otherwise_by_the_worker_s_metadata_is_the_same_package() -> None:
    caller = {"python": "3.11", "packages": {"PyYAML": "6.0", "ruamel.yaml": "0.18"}}
    worker = {"python": "3.11", "packages": {"pyyaml": "6.0", "ruamel-yaml": "0.18"}}
    assert versions.refusal(_answer(worker), caller) is None


def test_a_package_whose_module_is_named_otherwise_is_named_with_its_module() -> None:
    caller = {"python": "3.11", "packages": {"PyYAML": "6.0", "fakepkg": "9.9"}}
    worker = {"python": "3.11", "packages": {}}
    why = versions.refusal(_answer(worker), caller,
                           modules={"PyYAML": {"yaml"}, "fakepkg": {"fakepkg"}})
    assert why is not None
    assert "package PyYAML 6.0 (module yaml) on the caller's side, not installed" in why
    assert "package fakepkg 9.9 on the caller's side" in why


def test_a_module_without_package_metadata_no_worker_can_import_is_refused_naming_it() -> None:
    # Given a call that imports `unpackaged`, installed here with no package metadata, and
    # workers of the caller's versions that list what they can import, `unpackaged` not
    # among it
    caller = {"python": "3.11", "packages": {"numpy": "2.1.0"}}
    lacking = {"python": "3.11", "packages": {"numpy": "2.1.0"}, "modules": ["json", "numpy"]}
    # When the call is checked
    why = versions.refusal(_answer(lacking), caller, unpackaged={"unpackaged"})
    # Then it is refused naming the module, and what to do about a module, not a version
    assert why is not None
    assert ("module unpackaged (installed on the caller's side without package metadata) is "
            "not importable on the worker") in why
    assert "class cpu" in why and "nothing was stored" in why
    assert "Install the module on the workers" in why and "same versions" not in why
    # And a package that differs too is named beside it, with both pieces of advice
    both = versions.refusal(_answer(lacking), CALLER, unpackaged={"unpackaged"})
    assert both is not None and "package fakepkg 9.9" in both and "module unpackaged" in both
    assert "same versions" in both and "Install the module" in both


@pytest.mark.parametrize("envs", [
    [{"python": "3.11", "packages": {}, "modules": ["json", "unpackaged"]}],   # it has it
    [{"python": "3.11", "packages": {}, "modules": ["json"]},                  # one of them
     {"python": "3.11", "packages": {}, "modules": ["unpackaged"]}],
    [{"python": "3.11", "packages": {}}],             # an older worker's: no modules listed
])
def test_a_module_without_metadata_is_left_alone_where_a_worker_has_it_or_cannot_be_told(
        envs: list[dict[str, Any]]) -> None:
    caller = {"python": "3.11", "packages": {}}
    assert versions.refusal(_answer(*envs), caller, unpackaged={"unpackaged"}) is None


def test_the_environment_lists_the_top_level_modules_this_interpreter_can_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a directory on sys.path with a bare module, a package and a namespace directory
    (tmp_path / "bare_here.py").write_text("X = 1\n")
    (tmp_path / "pkg_here").mkdir()
    (tmp_path / "pkg_here" / "__init__.py").write_text("")
    (tmp_path / "ns_here").mkdir()
    (tmp_path / "not-a-module").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    # When the environment is read
    modules = environment()["modules"]
    # Then it names them, the installed packages', the standard library's and the built-in
    # ones, sorted, names only
    assert {"bare_here", "pkg_here", "ns_here", "cloudpickle", "json", "sys"} <= set(modules)
    assert "not-a-module" not in modules and "__pycache__" not in modules
    assert modules == sorted(set(modules))
