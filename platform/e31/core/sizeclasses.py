"""The size-class table and `route(spec) -> Route`: which queue a job waits in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from e31.core.errors import ConfigError, SpecError
from e31.core.resources import MAX_GPUS_PER_JOB
from e31.core.spec import JobSpec


class SizeClass(BaseModel):
    """A class of GPUs by memory; `gpu_mem_gb = 0` is the CPU class."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    gpu_mem_gb: int = Field(ge=0)


DEFAULT_SIZE_CLASSES = (
    SizeClass(name="cpu", gpu_mem_gb=0),
    SizeClass(name="gpu24", gpu_mem_gb=24),
    SizeClass(name="gpu48", gpu_mem_gb=48),
    SizeClass(name="gpu80", gpu_mem_gb=80),
    SizeClass(name="gpu141", gpu_mem_gb=141),
)


QUEUE_PREFIX = "e31."
# A GPU's reported memory (GiB, from NVML) is a little under its marketed size (GB):
# an "80 GB" card reports 80 GiB, a "24 GB" card 23.99 GiB, an H200 140.4 GiB.
GPU_MEM_TOLERANCE = 1.05


@dataclass(frozen=True)
class Route:
    size_class: str
    queue: str
    gpus: int


def queue_name(size_class: str, gpus: int = 1) -> str:
    """`e31.<class>` for one GPU (or cpu), `e31.<class>.x<N>` for an N-GPU group."""
    return f"{QUEUE_PREFIX}{size_class}" + (f".x{gpus}" if gpus > 1 else "")


def node_queue(host: str) -> str:
    """A host's own queue, which its gang workers consume: `e31.node.<host>`."""
    return f"{QUEUE_PREFIX}node.{host}"


def all_queues(classes: Sequence[SizeClass]) -> list[str]:
    """Every queue a job can be routed to: each GPU class once per GPU count, and cpu."""
    return [queue_name(c.name, n) for c in classes
            for n in (range(1, MAX_GPUS_PER_JOB + 1) if c.gpu_mem_gb else (1,))]


def gpu_classes(classes: Sequence[SizeClass]) -> list[SizeClass]:
    return sorted((c for c in classes if c.gpu_mem_gb > 0), key=lambda c: c.gpu_mem_gb)


def cpu_class(classes: Sequence[SizeClass]) -> SizeClass | None:
    return next((c for c in classes if c.gpu_mem_gb == 0), None)


def route(spec: JobSpec, classes: Sequence[SizeClass]) -> Route:
    """The smallest class that fits the spec, or the class it names; `SpecError` if none."""
    res = spec.resources
    by_name = {c.name: c for c in classes}
    if res.size_class is not None:
        chosen = by_name.get(res.size_class)
        if chosen is None:
            raise SpecError.one("resources.size_class", f"unknown size class {res.size_class!r}; "
                                                        f"known: {', '.join(by_name)}")
        if chosen.gpu_mem_gb == 0 and res.gpus > 0:
            raise SpecError.one("resources.gpus",
                                f"size class {chosen.name} has no GPUs; use gpus: 0")
        if chosen.gpu_mem_gb > 0 and res.gpus == 0:
            raise SpecError.one("resources.gpus", f"size class {chosen.name} needs gpus >= 1")
        if res.gpu_mem_gb is not None and res.gpu_mem_gb > chosen.gpu_mem_gb:
            raise SpecError.one("resources.gpu_mem_gb",
                                f"{res.gpu_mem_gb:g} GB does not fit size class {chosen.name} "
                                f"({chosen.gpu_mem_gb} GB)")
        return Route(chosen.name, queue_name(chosen.name, res.gpus), res.gpus)
    if res.gpus == 0:
        cpu = cpu_class(classes)
        if cpu is None:
            raise SpecError.one("resources.gpus", "this pool has no cpu class; ask for gpus >= 1")
        return Route(cpu.name, queue_name(cpu.name), 0)
    need = res.gpu_mem_gb or 0
    for c in gpu_classes(classes):
        if c.gpu_mem_gb >= need:
            return Route(c.name, queue_name(c.name, res.gpus), res.gpus)
    biggest = max(c.gpu_mem_gb for c in classes)
    raise SpecError.one("resources.gpu_mem_gb",
                        f"{need:g} GB is more than any size class offers (largest: {biggest} GB)")


def class_for_gpu(mem_gb: float, classes: Sequence[SizeClass]) -> SizeClass:
    """The largest class a GPU with `mem_gb` of memory can serve."""
    fitting = [c for c in gpu_classes(classes) if c.gpu_mem_gb <= mem_gb * GPU_MEM_TOLERANCE]
    if not fitting:
        smallest = gpu_classes(classes)[0]
        raise ConfigError(f"a {mem_gb:g} GB GPU is smaller than the smallest class "
                          f"{smallest.name} ({smallest.gpu_mem_gb} GB); leave it out with --gpus")
    return fitting[-1]


def spill_queues(own: SizeClass, gpus: int, classes: Sequence[SizeClass]) -> list[str]:
    """Queues a worker of class `own` consumes with --spill: its own first, then smaller GPU
    classes.

    The cpu class is never spilled onto a GPU: a CPU job would hold a GPU it does not use.
    """
    smaller = [c for c in gpu_classes(classes) if c.gpu_mem_gb < own.gpu_mem_gb]
    return [queue_name(own.name, gpus)] + [queue_name(c.name, gpus) for c in reversed(smaller)]


def redis_priority(size_class: str, classes: Sequence[SizeClass]) -> int:
    """Kombu Redis priority for a class: the biggest class 0 (popped first), smaller ones after.

    A worker that spills pops its own class before the smaller ones (docs/scheduling.md).
    """
    ordered = sorted(classes, key=lambda c: -c.gpu_mem_gb)
    names = [c.name for c in ordered]
    return min(names.index(size_class), 9) if size_class in names else 9


def next_class(size_class: str, classes: Sequence[SizeClass]) -> SizeClass | None:
    """The next bigger GPU class after `size_class`, or None at the biggest (or for cpu)."""
    ladder = gpu_classes(classes)
    names = [c.name for c in ladder]
    if size_class not in names or names.index(size_class) + 1 == len(names):
        return None
    return ladder[names.index(size_class) + 1]


@dataclass(frozen=True)
class OomRule:
    """Where a job goes after an attempt that ran out of memory (docs/scheduling.md, "Out of
    memory: the next size"): with `resources.on_oom: next_class` (or, when the spec sets none,
    the pool's `on_oom_default`), to the next bigger class's queue; `fail`, or at the biggest
    class: nowhere, the attempt ends as any `oom` does."""

    ladder: tuple[SizeClass, ...]
    default: str = "fail"

    @classmethod
    def of(cls, classes: Sequence[SizeClass], default: str) -> OomRule:
        return cls(tuple(gpu_classes(classes)), default)

    def target(self, on_oom: str | None, size_class: str, gpus: int) -> Route | None:
        """The route of the job's next attempt after an `oom`, or None when it stays put."""
        if (on_oom or self.default) != "next_class":
            return None
        bigger = next_class(size_class, self.ladder)
        return Route(bigger.name, queue_name(bigger.name, gpus), gpus) if bigger else None
