"""A sandboxed job sees the NVIDIA driver's nodes and only its own GPUs' /dev/nvidiaN, with
real bubblewrap: the device nodes are stand-ins made with mknod (each a /dev/null) in a
directory of their own, so that the test runs on a host without GPUs. Skipped, saying why,
where this machine cannot give a sandbox."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from e31.core.states import AttemptReason
from tests.integration.test_sandbox import Jail

LIST = ("import json, os\n"
        "print(json.dumps({'dev': sorted(n for n in os.listdir('/dev') if n.startswith('nvidia')),"
        " 'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), 'host': os.environ.get('E31_GPUS')}))")


def stand_in_devices(where: Path, gpus: int) -> Path:
    """A device directory holding nvidia0..N-1, nvidiactl and nvidia-uvm as character devices
    (each /dev/null's numbers: opening one is harmless)."""
    null = os.stat("/dev/null").st_rdev
    where.mkdir(mode=0o755)
    for name in [*(f"nvidia{i}" for i in range(gpus)), "nvidiactl", "nvidia-uvm"]:
        os.mknod(where / name, 0o666 | stat.S_IFCHR, null)
    return where


@pytest.mark.parametrize("held", ["1,3", ""], ids=["two-gpus", "cpu"])
def test_a_sandboxed_job_sees_only_its_own_gpus_device_nodes(
        held: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # Given a host with four GPUs' device nodes, and a job holding GPUs 1 and 3 (or none)
    jail = Jail(tmp_path)
    where = Path(tempfile.mkdtemp(prefix="e31-dev-"))   # bubblewrap, as the job's uid, must
    request.addfinalizer(lambda: shutil.rmtree(where))  # reach it, as it reaches /dev
    where.chmod(0o755)
    jail.sandbox.dev_dir = stand_in_devices(where / "dev", 4)
    jail.sandbox.driver_dir = tmp_path / "no-driver"
    p = jail.plan(command=[sys.executable, "-c", LIST])
    p = dataclasses.replace(p, gpus=held)

    # When it lists the NVIDIA nodes of its /dev
    result = jail.run(p)

    # Then it finds the driver's and its own GPUs' only, numbered for it from 0
    assert result.reason is AttemptReason.SUCCEEDED, p.log_path.read_text()
    seen = json.loads(p.log_path.read_text().splitlines()[-1])
    if held:
        assert seen["dev"] == ["nvidia-uvm", "nvidia1", "nvidia3", "nvidiactl"]
        assert seen["cuda"] == "0,1" and seen["host"] == "1,3"
    else:
        assert seen["dev"] == ["nvidia-uvm", "nvidiactl"]
