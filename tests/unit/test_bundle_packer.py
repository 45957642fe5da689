"""The client's packer: what goes into a bundle, what stays out, and that a tree always packs
to the same bytes."""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path

import pytest

from e31.client.bundle import pack
from e31.core.bundles import tar_problems
from e31.core.errors import SpecError


@pytest.fixture(autouse=True)
def packs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed bundles (temporary files) go where the test's files go."""
    (tmp_path / "packs").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "packs"))


def names(packed_path: Path) -> list[str]:
    with tarfile.open(packed_path) as tar:
        return tar.getnames()


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_gitignore_and_e31ignore_leave_files_out_and_git_is_skipped(tmp_path: Path) -> None:
    # Given a project with ignore files at the top and in a subdirectory, and a .git
    root = tree(tmp_path / "p", {
        ".gitignore": "*.log\n!keep.log\nbuild/\n",
        ".e31ignore": "data/big.bin\n",
        "train.py": "x", "run.log": "x", "keep.log": "x", "build/out.o": "x",
        "data/big.bin": "x", "data/small.csv": "x",
        "sub/.gitignore": "*.tmp\n", "sub/a.tmp": "x", "sub/a.py": "x",
        ".git/HEAD": "ref", ".git/config": "x",
    })

    # When it is packed
    packed = pack(root)

    # Then only what the ignore files let through is in the bundle
    assert names(packed.path) == [".e31ignore", ".gitignore", "data", "data/small.csv",
                                  "keep.log", "sub", "sub/.gitignore", "sub/a.py", "train.py"]
    assert packed.files == 7


def test_the_same_tree_packs_to_the_same_hash_whatever_its_times_and_modes(tmp_path: Path) -> None:
    # Given two copies of one tree, made at different times with different permissions
    a = tree(tmp_path / "a", {"m.py": "print(1)\n", "d/x.txt": "x"})
    b = tree(tmp_path / "b", {"m.py": "print(1)\n", "d/x.txt": "x"})
    os.utime(b / "m.py", (1, 1))
    os.chmod(b / "d" / "x.txt", 0o600)

    # Then they pack to the same bytes, and a changed byte changes the hash
    assert pack(a).digest == pack(b).digest == pack(a).digest
    (b / "m.py").write_text("print(2)\n")
    assert pack(b).digest != pack(a).digest


def test_an_executable_keeps_its_exec_bit_and_owners_are_cleared(tmp_path: Path) -> None:
    root = tree(tmp_path / "p", {"run.sh": "#!/bin/sh\n", "m.py": ""})
    os.chmod(root / "run.sh", 0o700)
    with tarfile.open(pack(root).path) as tar:
        modes = {m.name: (m.mode, m.uid, m.gid, m.uname, m.mtime) for m in tar.getmembers()}
    assert modes["run.sh"][0] == 0o755 and modes["m.py"][0] == 0o644
    assert {v[1:4] for v in modes.values()} == {(0, 0, "")}
    assert len({v[4] for v in modes.values()}) == 1


def test_a_link_inside_is_stored_as_a_link_and_a_link_out_is_skipped(tmp_path: Path) -> None:
    # Given links: one to a file inside, one to a directory inside, one out, one dangling
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    root = tree(tmp_path / "p", {"real.txt": "r", "lib/m.py": ""})
    (root / "alias.txt").symlink_to("real.txt")
    (root / "lib2").symlink_to(root / "lib")            # absolute, but inside
    (root / "leak.txt").symlink_to(secret)
    (root / "gone.txt").symlink_to(root / "missing")

    # When it is packed
    packed = pack(root)

    # Then the inside links are links (relative), the others are skipped and said so
    with tarfile.open(packed.path) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert members["alias.txt"].issym() and members["alias.txt"].linkname == "real.txt"
        assert members["lib2"].issym() and members["lib2"].linkname == "lib"
        assert "leak.txt" not in members and "gone.txt" not in members
        assert b"not yours" not in packed.path.read_bytes()
    assert sorted(s.split(":")[0] for s in packed.skipped) == ["gone.txt", "leak.txt"]
    with open(packed.path, "rb") as f:
        assert tar_problems(f) == []


def test_a_fifo_is_refused_naming_it(tmp_path: Path) -> None:
    root = tree(tmp_path / "p", {"m.py": ""})
    os.mkfifo(root / "pipe")
    with pytest.raises(SpecError) as refused:
        pack(root)
    assert refused.value.errors[0]["field"] == "workdir"
    assert "pipe" in refused.value.message and "FIFO" in refused.value.message


def test_a_tree_over_the_limit_is_refused_naming_its_biggest_files(tmp_path: Path) -> None:
    root = tree(tmp_path / "p", {"small.py": "x"})
    (root / "weights.bin").write_bytes(b"\0" * 300_000)
    (root / "data").mkdir()
    (root / "data" / "frames.npy").write_bytes(b"\0" * 200_000)

    with pytest.raises(SpecError) as refused:
        pack(root, max_bytes=100_000)

    message = refused.value.message
    assert "weights.bin (293.0 KiB)" in message and "data/frames.npy (195.3 KiB)" in message
    assert message.index("weights.bin") < message.index("frames.npy")
    assert "97.7 KiB" in message and "E31_BUNDLE_MAX_BYTES" in message and ".e31ignore" in message


def test_the_limit_comes_from_the_environment(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = tree(tmp_path / "p", {"a.txt": "x" * 5000})
    monkeypatch.setenv("E31_BUNDLE_MAX_BYTES", "4096")
    with pytest.raises(SpecError):
        pack(root)
    monkeypatch.setenv("E31_BUNDLE_MAX_BYTES", "1000000")
    assert pack(root).files == 1


def test_an_input_is_packed_under_its_own_name_with_no_ignore_files(tmp_path: Path) -> None:
    data = tree(tmp_path / "rows", {".gitignore": "*.csv\n", "a.csv": "1", "b/c.csv": "2"})
    single = tree(tmp_path, {"one.csv": "1,2\n"}) / "one.csv"
    assert names(pack(data, top="rows", ignore_files=False).path) == \
        ["rows", "rows/.gitignore", "rows/a.csv", "rows/b", "rows/b/c.csv"]
    assert names(pack(single, top="one.csv", ignore_files=False).path) == ["one.csv"]
