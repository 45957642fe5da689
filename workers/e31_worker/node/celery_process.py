"""One pinned Celery worker process:
`python -m e31_worker.node.celery_process --node ... --queues ...`.

The launcher starts it with `CUDA_VISIBLE_DEVICES` already set, and it never calls CUDA.

No thread of it dies alone (docs/reliability.md, "Threads"): each of ours catches what may
fail and goes on (the heartbeat, the log pump, the background upload); any other exception
that ends a thread of this process (one of ours on a fault not foreseen, Celery's or
Kombu's own) is logged `worker_thread_died` and ends the process (`EXIT_THREAD_DIED`), so
the launcher restarts it and the new process settles the attempt it held, rather than
leaving a worker that looks alive and serves nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from celery import signals

from e31.core.functioncalls import environment
from e31.edge import wiring
from e31.edge.settings import Settings
from e31.ops.drain import drain_authorized, request_drain
from e31.ops.heartbeat import WorkerInfo
from e31.ops.pyenvs import Publisher
from e31_worker.attempt.attemptlimits import default_mem_gb
from e31_worker.attempt.cgroups import JobCgroups, stack_place
from e31_worker.attempt.gangs import ledger_for
from e31_worker.attempt.groups import GroupRegistry, NodeLock
from e31_worker.attempt.sandbox import Sandbox
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.settle import settle_left_attempts
from e31_worker.attempt.spawn import Spawner
from e31_worker.attempt.task import register
from e31_worker.attempt.warm import WarmPool, WarmStarter, warm_env
from e31_worker.node.exits import EXIT_DRAINED, EXIT_NODE_TAKEN, EXIT_THREAD_DIED
from e31_worker.node.heartbeat import Heartbeat
from e31_worker.node.telemetry import GpuMonitor, GpuView, open_monitor

TELEMETRY_MAX_AGE_BEATS = 1.5   # a GPU reading older than this many beats is read again


def main(argv: list[str] | None = None) -> None:
    """Serve one node: take its name, build its attempts' services from the settings, settle
    what a dead predecessor left, then run Celery's worker until it stops."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.loglevel,
                        format=f"%(asctime)s {args.node} %(name)s %(levelname)s %(message)s")
    threading.excepthook = end_on_thread_death
    settings = Settings.load()
    pyenv = Publisher.reading(environment)   # what callers check their calls against
    identity = _identity(args, settings)
    groups = _take_node(identity, settings)
    services, beat, gpus = _services(args, settings, identity, groups, pyenv)
    settle_left_attempts(services)     # what it finished but could not record
    if services.warm is not None:
        services.warm.start()          # imports torch in the background; cold starts meanwhile
    _serve(args, settings, identity, services, beat, gpus)


def end_on_thread_death(args: threading.ExceptHookArgs) -> None:
    """`threading.excepthook` of the worker process: a thread that died of an exception
    (module docstring) ends the process, said first with its traceback."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger(__name__).critical(
        "worker_thread_died thread=%s: %s; ending the worker process so that its launcher "
        "restarts it", name, args.exc_type.__name__,
        exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback))
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_THREAD_DIED)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="e31_worker.node.celery_process")
    parser.add_argument("--node", required=True)
    parser.add_argument("--queues", required=True, help="comma-separated, own class first")
    parser.add_argument("--gpus", default="")
    parser.add_argument("--gpu-count", type=int, default=0)
    parser.add_argument("--size-class", required=True)
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument("--simulated-gpu-mem-gb", default="",
                        help="comma-separated memory of each GPU when they are simulated")
    parser.add_argument("--gang", default="",
                        help="a gang worker: its host's GPU sets, as JSON [[gpus, [queue, ...]]]")
    parser.add_argument("--host-slots", type=int, default=1,
                        help="worker processes on this host: a job without resources.mem_gb "
                             "gets the host's memory / this (unless default_mem_gb is set)")
    return parser


def _identity(args: argparse.Namespace, settings: Settings) -> WorkerInfo:
    """The worker as its heartbeats and its attempts name it: node, queues, GPUs, gang (its
    heartbeat adds the digest of its Python environment once read)."""
    return WorkerInfo(node=args.node, queues=tuple(args.queues.split(",")), gpus=args.gpus,
                      gpu_count=args.gpu_count, size_class=args.size_class,
                      isolation=settings.isolation,
                      network=(settings.job_network if settings.isolation == "sandbox"
                               else "host"),
                      gang=tuple((str(g), tuple(q)) for g, q in json.loads(args.gang or "[]")))


def _take_node(identity: WorkerInfo, settings: Settings) -> GroupRegistry:
    """Hold the node's name for this process (exit EXIT_NODE_TAKEN when another holds it),
    and reap what a dead predecessor's jobs left running; returns the node's job groups."""
    # Per node: a restarted worker process finds what its predecessor left running.
    groups_dir = settings.resolved_work_dir / ".groups"
    node_lock = NodeLock(groups_dir / f"{identity.node}.lock")  # held until this process ends
    taken_by = node_lock.acquire()
    if taken_by is not None:
        logging.getLogger(__name__).error(
            "node_taken node=%s pid=%d: another worker process serves this node name; give each "
            "`e31 worker` on a host its own --gpus or --hostname", identity.node, taken_by)
        sys.exit(EXIT_NODE_TAKEN)
    groups = GroupRegistry(groups_dir / identity.node)
    groups.reap()                      # what a dead predecessor's jobs left running
    return groups


def _services(args: argparse.Namespace, settings: Settings, identity: WorkerInfo,
              groups: GroupRegistry, pyenv: Publisher | None = None
              ) -> tuple[AttemptServices, Heartbeat, GpuMonitor | None]:
    """The attempts' services, the node's heartbeat and its GPUs' monitor, built from the
    settings."""
    # The node's cgroup directory is this stack's own (a hash of its work_dir): reaping it at
    # start never kills the jobs of another stack whose node has the same name.
    cgroups = JobCgroups.for_node(identity.node, place=stack_place(settings.resolved_work_dir))
    if cgroups is not None:
        cgroups.reap()
    redis_client = wiring.redis_client(settings)
    repo = wiring.attempt_store(settings, node=identity.node)
    gpus = gpu_monitor(",".join(gang_gpus(identity)) or args.gpus, args.simulated_gpu_mem_gb,
                       settings, held=gang_held(identity, settings))
    own_gpus = GpuView(gpus, args.gpus) if gpus is not None and identity.gang else gpus
    # An operator's drain takes Celery's own warm-shutdown path, exactly as SIGTERM does; so
    # does the node's own, for a GPU's XID error.
    beat = Heartbeat(redis_client=redis_client, identity=identity,
                     interval_s=settings.heartbeat_interval_s,
                     on_drain=lambda: os.kill(os.getpid(), signal.SIGTERM),
                     drain_authorized=lambda: drain_authorized(repo, identity.node),
                     gpus=own_gpus,
                     record_drain=lambda why: request_drain(redis_client, repo, [identity.node],
                                                            reason=why),
                     pyenv=pyenv)
    services = AttemptServices(settings=settings, identity=identity, repo=repo,
                               artifacts=wiring.artifacts(settings), redis=redis_client,
                               groups=groups, cgroups=cgroups, draining=beat.draining,
                               gpu_fault=beat.gpu_fault,
                               busy=beat.set_busy, last_beat=lambda: beat.last_beat,
                               sandbox=(Sandbox.from_settings(settings)
                                        if settings.isolation == "sandbox" else None),
                               gpus=gpus,
                               warm=(warm_pool(settings) if settings.warm_start else None),
                               spawner=Spawner(),
                               default_mem_gb=default_mem_gb(settings, args.host_slots))
    logging.getLogger(__name__).info(
        "attempt_limits node=%s pids_max=%s default_mem_gb=%s disk_gb=%s",
        identity.node, settings.attempt_pids_max if cgroups and cgroups.caps_pids else None,
        services.default_mem_gb if cgroups else None, settings.attempt_disk_gb)
    return services, beat, gpus


def _serve(args: argparse.Namespace, settings: Settings, identity: WorkerInfo,
           services: AttemptServices, beat: Heartbeat, gpus: GpuMonitor | None) -> None:
    """Run Celery's worker on the node's queues, the heartbeat from ready to shutdown; then
    close the warm processes and the GPU monitor, and exit EXIT_DRAINED when drained."""
    app = wiring.celery(settings, queues=list(identity.queues))
    register(app, services)

    def _ready(**_: Any) -> None:
        beat.start()

    def _shutting_down(**_: Any) -> None:
        beat.stop()  # running job: SIGTERM, grace, requeued as `drained`

    signals.worker_ready.connect(_ready, weak=False)
    signals.worker_shutting_down.connect(_shutting_down, weak=False)
    try:
        # Task events as the app's settings say (`celery_events`): with "flower", none until
        # a Flower's enable_events; Celery's worker heartbeat keeps the event dispatcher that
        # it switches on, and Flower's worker list
        app.worker_main(["worker", "--pool", "threads", "--concurrency", "1",
                         "--hostname", args.node, "--queues", ",".join(identity.queues),
                         "--loglevel", args.loglevel, "--without-gossip", "--without-mingle"])
    finally:
        if services.warm is not None:
            services.warm.close()
        if services.spawner is not None:
            services.spawner.close()
        if gpus is not None:
            gpus.close()
        if beat.drain_requested.is_set():
            logging.getLogger(__name__).warning("worker_drained node=%s", args.node)
            sys.exit(EXIT_DRAINED)


def warm_pool(settings: Settings) -> WarmPool:
    """The worker process's warm processes: its environment's, and its job environments'
    within `warm_memory_budget_mb` (docs/architecture.md, "The warm start")."""
    env = warm_env(os.environ, settings.job_env_passthrough)
    return WarmPool(WarmStarter(preload=settings.preload, env=env),
                    budget_bytes=settings.warm_memory_budget_mb * 2**20,
                    preload=settings.preload, env=env)


def gang_gpus(identity: WorkerInfo) -> list[str]:
    """A gang worker's host GPUs, in index order (none for any other worker)."""
    return sorted({i for gpus, _ in identity.gang for i in gpus.split(",") if i}, key=int)


def gang_held(identity: WorkerInfo, settings: Settings) -> Callable[[], list[int]] | None:
    """For a gang worker, the GPUs of its host held now (its ledger): what its simulated GPUs
    read as busy. None for any other worker (its own job holds its GPUs)."""
    if not identity.gang:
        return None
    ledger = ledger_for(settings.resolved_work_dir, identity.host)
    return lambda: [int(g) for g in ledger.holders()]


def gpu_monitor(gpus: str, simulated_mem_gb: str, settings: Settings,
                held: Callable[[], list[int]] | None = None) -> GpuMonitor | None:
    """The telemetry of the node's GPUs (`--gpus` indexes), simulated when their memories are
    given (`held`: which of them a gang host's attempts hold); a reading counts as current
    for one heartbeat and a half."""
    indexes = [int(i) for i in gpus.split(",") if i.strip()]
    memories = [float(m) for m in simulated_mem_gb.split(",") if m.strip()]
    return open_monitor(indexes, simulated_mem_gb=memories, simulated_held=held,
                        max_age_s=settings.heartbeat_interval_s * TELEMETRY_MAX_AGE_BEATS)


if __name__ == "__main__":
    main(sys.argv[1:])
