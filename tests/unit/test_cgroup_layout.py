"""Where an attempt's memory and pids cgroups go, on cgroup v1 (one hierarchy per controller)
and v2 (one directory, controllers enabled in the parent): read from /proc/self/cgroup, and
made in a stand-in tree (the real kernel's are in tests/integration/test_limits.py)."""

from __future__ import annotations

from pathlib import Path

from e31_worker.attempt.cgroups import JobCgroups, Layout, detect

V1 = ("9:name=systemd:/\n8:pids:/worker.slice\n4:memory:/worker.slice/e31\n"
      "1:cpu,cpuacct:/\n0::/\n")


def tree(tmp_path: Path, *dirs: str) -> Path:
    root = tmp_path / "cgroup"
    for d in dirs:
        (root / d).mkdir(parents=True)
    return root


def test_v1_puts_the_pids_cgroup_under_the_workers_own_in_the_pids_hierarchy(
        tmp_path: Path) -> None:
    root = tree(tmp_path, "memory", "pids")
    (tmp_path / "self").write_text(V1)
    assert detect(root, tmp_path / "self") == Layout(
        parent=root / "memory" / "worker.slice" / "e31", version=1,
        pids_parent=root / "pids" / "worker.slice")


def test_v1_without_a_pids_hierarchy_has_memory_only(tmp_path: Path) -> None:
    root = tree(tmp_path, "memory")
    (tmp_path / "self").write_text(V1)
    layout = detect(root, tmp_path / "self")
    assert layout is not None and layout.pids_parent is None


def test_v2_uses_one_directory_for_both(tmp_path: Path) -> None:
    root = tree(tmp_path, "worker.slice")
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "self").write_text("0::/worker.slice\n")
    parent = root / "worker.slice"
    assert detect(root, tmp_path / "self") == Layout(parent=parent, version=2,
                                                     pids_parent=parent)


def test_a_v1_attempt_joins_both_hierarchies_with_both_limits_written(tmp_path: Path) -> None:
    # Given a v1 layout (directories stand in for the kernel's)
    root = tree(tmp_path, "memory/w", "pids/w")
    groups = JobCgroups.for_node("cpu0@h", Layout(parent=root / "memory" / "w", version=1,
                                                  pids_parent=root / "pids" / "w"))
    assert groups is not None and groups.caps_pids

    # When an attempt's cgroup is made
    cgroup = groups.create("j-1", 2, memory_max_bytes=1 << 30, pids_max=64)

    # Then it has a directory in each hierarchy, each with its limit, and joins both
    assert cgroup is not None
    mem, pids = root / "memory" / "w" / "e31-cpu0_h" / "j-1-a2", root / "pids" / "w" / \
        "e31-cpu0_h" / "j-1-a2"
    assert (mem / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (pids / "pids.max").read_text() == "64"
    assert cgroup.procs_files == [mem / "cgroup.procs", pids / "cgroup.procs"]
    assert (cgroup.pids_max, cgroup.memory_max_bytes) == (64, 1 << 30)


def test_a_v2_attempt_has_one_directory_with_memory_and_pids_enabled_above_it(
        tmp_path: Path) -> None:
    parent = tree(tmp_path, "w") / "w"
    groups = JobCgroups.for_node("gpu0@h", Layout(parent=parent, version=2, pids_parent=parent))
    assert groups is not None

    cgroup = groups.create("j-1", 1, memory_max_bytes=None, pids_max=128)

    assert cgroup is not None
    assert (parent / "e31-gpu0_h" / "cgroup.subtree_control").read_text() == "+pids"
    assert (cgroup.path / "pids.max").read_text() == "128"
    assert cgroup.procs_files == [cgroup.path / "cgroup.procs"]
    assert cgroup.memory_max_bytes is None


def test_without_a_pids_controller_an_attempt_is_not_capped_and_says_so(tmp_path: Path) -> None:
    root = tree(tmp_path, "memory/w")
    groups = JobCgroups.for_node("cpu0@h", Layout(parent=root / "memory" / "w", version=1))
    assert groups is not None and not groups.caps_pids
    cgroup = groups.create("j-1", 1, memory_max_bytes=1 << 20, pids_max=64)
    assert cgroup is not None and cgroup.pids_max is None
    assert cgroup.procs_files == [cgroup.path / "cgroup.procs"]
