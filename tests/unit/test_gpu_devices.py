"""Which NVIDIA device nodes a job's sandbox gets (`e31_worker.attempt.sandbox`), against a
stand-in device directory and driver directory: the driver's own nodes and the /dev/nvidiaN
of the GPUs it holds, no other GPU's; and how the job then numbers its GPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from e31.edge.settings import Settings
from e31_worker.attempt.sandbox import AttemptSandbox, Sandbox, gpu_device_args, gpu_minors

CONTROL = ["nvidia-caps", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidiactl"]


def fake_dev(tmp_path: Path, gpus: int = 4) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [*(f"nvidia{i}" for i in range(gpus)), *CONTROL[1:]]:
        (dev / name).touch()
    (dev / "nvidia-caps").mkdir()
    (dev / "null").touch()
    return dev


def bound(args: list[str]) -> list[str]:
    """The /dev names the arguments bind."""
    return sorted(args[i + 2].removeprefix("/dev/") for i, a in enumerate(args)
                  if a == "--dev-bind-try")


def test_a_job_gets_the_drivers_nodes_and_only_its_own_gpus_nodes(tmp_path: Path) -> None:
    # Given a host with four GPUs' device nodes and the driver's control nodes
    dev = fake_dev(tmp_path)

    # When a job holds GPUs 1 and 3; another holds none; the last holds all four
    two = bound(gpu_device_args([1, 3], dev_dir=dev, driver_dir=tmp_path / "none"))
    none = bound(gpu_device_args([], dev_dir=dev, driver_dir=tmp_path / "none"))
    every = bound(gpu_device_args([0, 1, 2, 3], dev_dir=dev, driver_dir=tmp_path / "none"))

    # Then each sandbox binds the control nodes and the nodes of its own GPUs only
    assert two == sorted([*CONTROL, "nvidia1", "nvidia3"])
    assert none == sorted(CONTROL)
    assert every == sorted([*CONTROL, "nvidia0", "nvidia1", "nvidia2", "nvidia3"])


def test_a_gpus_node_is_found_by_its_device_minor_in_pci_bus_order(tmp_path: Path) -> None:
    # Given a driver whose GPUs' minors are not their indexes in PCI bus order
    dev = fake_dev(tmp_path)
    driver = tmp_path / "gpus"
    for bus, minor in (("0000:17:00.0", 2), ("0000:3b:00.0", 0), ("0000:86:00.0", 3),
                       ("0000:af:00.0", 1)):
        (driver / bus).mkdir(parents=True)
        (driver / bus / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nDevice Minor: \t {minor}\n")

    # When the job holds GPU index 0 (the first bus) and 3 (the last)
    assert gpu_minors(driver) == {0: 2, 1: 0, 2: 3, 3: 1}
    args = bound(gpu_device_args([0, 3], dev_dir=dev, driver_dir=driver))

    # Then it gets those GPUs' nodes, nvidia2 and nvidia1
    assert [a for a in args if a[-1].isdigit()] == ["nvidia1", "nvidia2"]


needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="viewing an attempt hands its root to the job's uid")


@needs_root
def test_a_job_numbers_its_gpus_from_zero_where_only_their_nodes_are_there(
        tmp_path: Path) -> None:
    # Given a sandbox on a host with GPU device nodes
    sandbox = Sandbox.from_settings(Settings.load({"home": str(tmp_path / "home"),
                                                   "job_network": "host"}, environ={}))
    sandbox.dev_dir = fake_dev(tmp_path)
    sandbox.driver_dir = tmp_path / "none"
    attempt = AttemptSandbox(sandbox, uid=424242, network="host")
    root = tmp_path / "attempt"
    (root / "work").mkdir(parents=True)

    # When a job holding GPUs 3 and 1 (in that order) is viewed
    view, env = attempt.warm_view({"CUDA_VISIBLE_DEVICES": "3,1"}, root=root, writable=[],
                                  read_only=[])

    # Then CUDA sees its two GPUs as 1 and 0 (PCI order), the host's indexes are said too,
    # and only their nodes are bound
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0" and env["E31_GPUS"] == "3,1"
    assert [a for a in bound(view) if a[-1].isdigit()] == ["nvidia1", "nvidia3"]


@needs_root
def test_simulated_gpus_keep_the_hosts_indexes(tmp_path: Path) -> None:
    # Given a host without GPU device nodes (simulated GPUs)
    sandbox = Sandbox.from_settings(Settings.load({"home": str(tmp_path / "home"),
                                                   "job_network": "host"}, environ={}))
    sandbox.dev_dir = tmp_path / "empty-dev"
    attempt = AttemptSandbox(sandbox, uid=424242, network="host")
    root = tmp_path / "attempt"
    (root / "work").mkdir(parents=True)

    # When a job holding simulated GPU 1 is viewed
    view, env = attempt.warm_view({"CUDA_VISIBLE_DEVICES": "1"}, root=root, writable=[],
                                  read_only=[])

    # Then it sees index 1, as the simulated pool promises, and no device node
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and "E31_GPUS" not in env
    assert bound(view) == []
