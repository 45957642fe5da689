"""Requirements are requirements, nothing else (`e31.core.requirements`): every form that would make
uv read a file, an index or a variable the pool did not choose is refused, naming the field and
the line; plain requirements, comments and blank lines are taken. Also how the API reads the
file out of a bundle (`e31.edge.bundlefiles`), what the worker refuses before it builds, and what a
build keeps of the worker's environment (issue 25)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from e31.core.errors import SetupError, SpecError
from e31.core.pythonenv import PythonEnv
from e31.core.requirements import requirement_problem, requirements_refusals
from e31.core.spec import JobSpec
from e31.edge.bundlefiles import read_member
from e31_worker.attempt.buildbox import operator_paths
from e31_worker.attempt.environment import EnvRequest, build_env

REFUSED = {
    "-r /etc/shadow": "is an option",
    "--requirement=/proc/1/environ": "is an option",
    "-c /home/e31/secrets.key": "is an option",
    "-e .": "is an option",
    "--editable ./pkg": "is an option",
    "-i https://evil.example/simple": "is an option",
    "--index-url https://evil.example/simple": "is an option",
    "--extra-index-url=https://evil.example/simple": "is an option",
    "-f /var/lib/e31": "is an option",
    "--find-links https://evil.example/wheels": "is an option",
    "--trusted-host evil.example": "is an option",
    "--no-index": "is an option",
    "/etc/shadow": "is a path",
    "./pkg": "is a path",
    "../other-tenant/out": "is a path",
    "~/secrets": "is a path",
    "sub/dir": "is a path",
    "file:///etc/shadow": "is a URL",
    "https://evil.example/pkg-1.0.tar.gz": "is a URL",
    "git+https://github.com/evil/pkg": "is a URL",
    "pkg @ file:///etc/shadow": "is a file: URL",
    "pkg @ /etc/shadow": "is a path",
    "pkg @ https://evil.example/pkg-1.0-py3-none-any.whl": "is a direct URL",
    "pkg @ git+https://github.com/evil/pkg@main": "is a VCS URL",
    "pkg-1.0-py3-none-any.whl": "is a path to an archive or a wheel",
    "pkg.tar.gz": "is a path to an archive or a wheel",
    "pkg==${E31_REDIS_PASSWORD}": "names an environment variable",
    "pkg==1.0 --hash=sha256:" + "0" * 64: "carries an option",
    "pkg==1.0 \\": "a line continuation",
    "pkg\x1b[2J": "control character",
    "not a requirement!": "is not a requirement",
}

TAKEN = [
    "tomli-w",
    "tomli-w==1.2.0",
    "Tomli_W >= 1.0, < 2",
    "pkg[extra1,extra2]~=1.4",
    "pkg>=1; python_version >= '3.9' and sys_platform == 'linux'",
    "pkg===1.0.local",
    "zope.interface!=5.0",
]


@pytest.mark.parametrize("line", list(REFUSED))
def test_each_form_that_is_no_plain_requirement_is_refused_saying_what_it_is(line: str) -> None:
    # Given a line that would make uv read more than a package's name
    # When it is checked as a pip item and as a line of a requirements file
    item = requirement_problem(line)
    [refusal] = requirements_refusals(f"tomli-w\n{line}\n")

    # Then both refuse it, saying what it is, and the file's refusal names line 2
    assert item is not None and REFUSED[line] in item
    assert refusal.line == 2 and REFUSED[line] in refusal.reason
    assert str(refusal).startswith("line 2: ")


@pytest.mark.parametrize("line", TAKEN)
def test_names_extras_versions_and_markers_are_taken(line: str) -> None:
    assert requirement_problem(line) is None
    assert requirements_refusals(f"{line}\n") == []


def test_comments_blank_lines_and_windows_line_ends_are_fine() -> None:
    text = ("\ufeff# what train needs\r\n\r\n   \ntomli-w==1.2.0  # pinned\r\n"
            "pkg @ https://x.example/p.whl#egg=p\n")  # a fragment is no comment
    [refusal] = requirements_refusals(text)
    assert refusal.line == 5 and "direct URL" in refusal.reason


def test_an_option_behind_a_comment_line_ending_in_a_backslash_is_still_refused() -> None:
    # pip joins no comment line; whatever another reader does, each line is checked alone
    [refusal] = requirements_refusals("# see below \\\n-r /etc/shadow\n")
    assert refusal.line == 2 and "is an option" in refusal.reason


def test_every_refused_line_is_named_and_long_lines_are_shortened() -> None:
    refused = requirements_refusals("-r /a\nok\n-c /b\n" + "x" * 500 + " @ file:///c\n")
    assert [r.line for r in refused] == [1, 3, 4]
    assert len(str(refused[2])) < 400 and "…" in str(refused[2])


def test_a_pip_item_spanning_lines_is_refused() -> None:
    assert "several lines" in (requirement_problem("tomli-w\n-r /etc/shadow") or "")


# -- the spec: python.pip[i] -------------------------------------------------------------------

@pytest.mark.parametrize("item", ["pkg @ file:///proc/self/environ", "-r /etc/shadow",
                                  "git+https://github.com/evil/pkg", "pkg==${SECRET}"])
def test_a_spec_refuses_a_pip_item_that_is_no_plain_requirement_naming_its_index(
        item: str) -> None:
    with pytest.raises(SpecError) as refused:
        JobSpec.parse({"command": ["true"], "python": {"pip": ["tomli-w", item]}})
    [error] = refused.value.errors
    assert error["field"] == "python.pip[1]"
    assert REFUSED.get(item, "") in error["reason"] or "is a" in error["reason"]


# -- the worker: a spec stored before the check ------------------------------------------------

def test_the_worker_refuses_a_stored_pip_item_naming_the_field(tmp_path: Path) -> None:
    # Given a python field that bypassed validation (as a spec stored before the check)
    python = PythonEnv.model_construct(pip=["tomli-w", "pkg @ file:///etc/shadow"],
                                       requirements=None)
    # When the worker makes its request, Then it refuses before anything runs
    with pytest.raises(SetupError, match=r"python\.pip\[1\]: 'pkg @ file:///etc/shadow' is a "
                                         r"file: URL"):
        EnvRequest.of(python, None)


def test_the_worker_refuses_a_requirements_file_naming_the_file_and_the_line(
        tmp_path: Path) -> None:
    # Given a job's code whose requirements file includes a file of the host
    (tmp_path / "requirements.txt").write_text("# deps\ntomli-w\n-r /etc/shadow\n")

    # When the worker reads it
    with pytest.raises(SetupError) as refused:
        EnvRequest.of(PythonEnv(requirements="requirements.txt"), tmp_path)

    # Then it names the field, the file and the line, quoting only that line
    assert str(refused.value) == (
        "python.requirements: requirements.txt, line 3: '-r /etc/shadow' is an option (-r, "
        "-c, -e, --index-url, --find-links, …); a job's requirements name packages only "
        "(name, extras, version, marker); the package index is the pool's")


# -- the API's read of one file of a bundle ---------------------------------------------------

def bundle(*members: tuple[str, str, bytes | str]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tar.addfile(info)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                raw = data if isinstance(data, bytes) else data.encode()
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    buf.seek(0)
    return buf


MEMBERS = (("./requirements.txt", "file", "a\n"), ("sub", "dir", b""),
           ("sub/reqs.txt", "file", "b\n"), ("linked", "link", "sub"),
           ("up", "link", "sub/../requirements.txt"), ("out", "link", "../../etc/shadow"),
           ("abs", "link", "/etc/shadow"), ("loop", "link", "loop"),
           ("big.txt", "file", "x" * 100))


@pytest.mark.parametrize(("path", "content"), [
    ("requirements.txt", b"a\n"), ("./sub/../requirements.txt", b"a\n"),
    ("sub/reqs.txt", b"b\n"), ("linked/reqs.txt", b"b\n"), ("up", b"a\n")])
def test_a_file_of_a_bundle_is_read_as_its_unpacked_copy_shows_it(path: str,
                                                                  content: bytes) -> None:
    assert read_member(bundle(*MEMBERS), path, max_bytes=64) == content


@pytest.mark.parametrize("path", ["missing.txt", "out", "abs", "loop", "../requirements.txt"])
def test_a_file_the_bundle_lacks_or_links_out_to_is_not_found(path: str) -> None:
    with pytest.raises(FileNotFoundError):
        read_member(bundle(*MEMBERS), path, max_bytes=64)


def test_a_directory_an_oversized_file_and_no_tar_are_refused() -> None:
    with pytest.raises(ValueError, match="not a regular file"):
        read_member(bundle(*MEMBERS), "sub", max_bytes=64)
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        read_member(bundle(*MEMBERS), "big.txt", max_bytes=64)
    with pytest.raises(ValueError, match="cannot be read"):
        read_member(io.BytesIO(b"not a tar" * 100), "x", max_bytes=64)


# -- what a build keeps of the worker's environment -------------------------------------------

def test_a_build_keeps_only_the_operators_uv_settings_the_way_out_and_the_locale(
        tmp_path: Path) -> None:
    worker = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "UV_INDEX_URL": "https://mirror/simple",
              "HTTPS_PROXY": "http://proxy:3128", "SSL_CERT_FILE": "/etc/ssl/ca.pem",
              "E31_REDIS_PASSWORD": "hunter2", "AWS_SECRET_ACCESS_KEY": "k", "HOME": "/root",
              "PIP_INDEX_URL": "https://evil/simple", "UV_CACHE_DIR": "/root/.cache/uv"}
    env = build_env(worker, scratch=tmp_path)
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "UV_INDEX_URL": "https://mirror/simple",
                   "HTTPS_PROXY": "http://proxy:3128", "SSL_CERT_FILE": "/etc/ssl/ca.pem",
                   "HOME": str(tmp_path), "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
                   "UV_PYTHON_DOWNLOADS": "never", "NO_COLOR": "1"}


def test_the_operators_local_index_and_uv_config_are_what_a_sandboxed_build_sees(
        tmp_path: Path) -> None:
    for d in ("mirror/simple", "mirror/files", "wheels", "more"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "uv.toml").write_text("")
    env = {"UV_INDEX_URL": f"file://{tmp_path}/mirror/simple",
           "UV_EXTRA_INDEX_URL": f"https://pypi.org/simple file://{tmp_path}/more",
           "UV_FIND_LINKS": f"{tmp_path}/wheels,https://x/wheels",
           "UV_INDEX": f"internal=file://{tmp_path}/gone", "UV_CONFIG_FILE": f"{tmp_path}/uv.toml"}
    assert sorted(operator_paths(env)) == sorted(
        [tmp_path / "uv.toml", tmp_path / "mirror", tmp_path / "more", tmp_path / "wheels"])
