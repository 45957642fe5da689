"""GPU discovery, in the launcher only: NVML, else `nvidia-smi`, else `--simulate-gpus`.

Never `torch.cuda`: it initialises CUDA in the calling process.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass

from e31.core.errors import ConfigError

log = logging.getLogger(__name__)

MIB_PER_GB = 1024
_SIM = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class Gpu:
    index: int
    mem_gb: float
    name: str = "simulated"
    simulated: bool = False   # from --simulate-gpus: its telemetry is made up, and says so


def parse_simulated(text: str) -> list[Gpu]:
    """`2x24,1x80` -> GPUs 0 and 1 with 24 GB, GPU 2 with 80 GB, indexes in the order listed."""
    gpus: list[Gpu] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _SIM.match(part)
        if not m or int(m.group(1)) < 1:
            raise ConfigError(f"--simulate-gpus: {part!r} is not COUNTxGB (e.g. 2x24,1x80)")
        for _ in range(int(m.group(1))):
            gpus.append(Gpu(index=len(gpus), mem_gb=float(m.group(2)), simulated=True))
    if not gpus:
        raise ConfigError("--simulate-gpus: give at least one COUNTxGB")
    return gpus


def discover() -> list[Gpu]:
    """The machine's GPUs, without touching CUDA; [] when there are none."""
    try:
        return _nvml()
    except Exception as exc:  # noqa: BLE001 - no driver, no library: try the next way
        log.debug("nvml unavailable: %s", exc)
    return _nvidia_smi()


def _nvml() -> list[Gpu]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / (1024 ** 3)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(Gpu(index=i, mem_gb=round(mem, 1),
                           name=name.decode() if isinstance(name, bytes) else str(name)))
        return out
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi() -> list[Gpu]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        text = subprocess.run([exe, "--query-gpu=index,memory.total,name",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("nvidia-smi failed: %s", exc)
        return []
    gpus = []
    for line in text.strip().splitlines():
        index, mem_mib, name = (p.strip() for p in line.split(",", 2))
        gpus.append(Gpu(index=int(index), mem_gb=round(float(mem_mib) / MIB_PER_GB, 1), name=name))
    return gpus


def select(gpus: list[Gpu], which: str) -> list[Gpu]:
    """`all`, or a list like `0,1` / a range like `0-3`."""
    if which == "all":
        return gpus
    wanted: list[int] = []
    for part in filter(None, (p.strip() for p in which.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError as exc:
            raise ConfigError(f"--gpus: {part!r} is not an index or a range like 0-3") from exc
        if last < first:
            raise ConfigError(f"--gpus: range {part!r} runs backwards")
        wanted.extend(range(first, last + 1))
    if len(set(wanted)) != len(wanted):
        raise ConfigError(f"--gpus: {which!r} names a GPU twice; each GPU gets one worker")
    by_index = {g.index: g for g in gpus}
    missing = [i for i in wanted if i not in by_index]
    if missing:
        raise ConfigError(f"--gpus: no GPU {missing[0]} on this machine "
                          f"(found {sorted(by_index) or 'none'})")
    return [by_index[i] for i in wanted]
