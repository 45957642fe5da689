"""`e31 worker`: one pinned Celery worker process per GPU (or GPU group, or CPU slot),
each restarted if it dies, all stopped (drained) on SIGTERM / Ctrl-C.

The launcher beats too, for each node it runs (`e31.ops.heartbeat.beat_launcher`): a worker
process that went silent while its launcher lives is being restarted (its successor says
whether it holds its job) or is frozen, and the scheduler leaves its job to its lease; a
node whose launcher went silent with it died whole, and its jobs run again within seconds
(docs/reliability.md, "A dead node noticed in seconds").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import redis

from e31.core.clock import utcnow
from e31.core.errors import ConfigError, E31Error
from e31.core.sizeclasses import (
    SizeClass,
    class_for_gpu,
    cpu_class,
    node_queue,
    queue_name,
    spill_queues,
)
from e31.edge import wiring
from e31.edge.settings import Settings
from e31.ops.drain import DRAIN_REQUEST_TTL_S, clear_drain
from e31.ops.heartbeat import beat_launcher
from e31_worker.child.spawner import PR_SET_PDEATHSIG, prctl_function
from e31_worker.node.exits import EXIT_DRAINED
from e31_worker.node.gpus import Gpu
from e31_worker.node.release import release_dead_worker

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0       # first wait before restarting a dead worker process
RESTART_BACKOFF_MAX_S = 30.0  # doubled per quick death, up to this
# A death this soon after a start is a crash loop (bad config, a broken node), backed off;
# a later one (killed after serving) is restarted after the first back-off again.
QUICK_DEATH_S = 10.0
SUPERVISE_POLL_S = 0.5        # how often the launcher looks at its worker processes
STOP_EXTRA_S = 15.0           # beyond the kill grace, for Celery to ack and exit
UNDRAIN_POLL_S = 2.0          # keep_drains: how often the store is asked for undrained nodes
BEAT_REDIS_TIMEOUT_S = 2.0    # the launcher's beat never holds up its watch of its workers
START_RELEASE_WAIT_S = 5.0    # at start, for the release of what the nodes held before


@dataclass(frozen=True)
class WorkerSlot:
    node: str
    queues: tuple[str, ...]
    gpus: str
    gpu_count: int
    size_class: str
    simulated_mem_gb: tuple[float, ...] = ()   # --simulate-gpus: each GPU's memory; () real
    gang: tuple[tuple[str, tuple[str, ...]], ...] = ()   # a gang worker: its host's GPU sets


GANG_SIZES = (1, 2, 4, 8)     # the GPU counts a job may ask for on one node


def gang_sets(gpus: Sequence[Gpu], *, spill: bool,
              classes: Sequence[SizeClass]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A gang host's GPU sets a job may be given, each with the queues it serves: every GPU
    alone, and every aligned block of 2, 4 and 8 (GPUs 0-1, 2-3; 0-3, 4-7; 0-7), of the
    smallest class among its GPUs. Aligned blocks keep a partly busy node's free GPUs whole
    for the next big job (docs/scheduling.md, "Gangs on demand")."""
    out = []
    for size in (k for k in GANG_SIZES if k <= len(gpus)):
        for start in range(0, len(gpus) - size + 1, size):
            members = list(gpus[start:start + size])
            own = min((class_for_gpu(g.mem_gb, classes) for g in members),
                      key=lambda c: c.gpu_mem_gb)
            queues = spill_queues(own, size, classes) if spill else [queue_name(own.name, size)]
            out.append((",".join(str(g.index) for g in members), tuple(queues)))
    return tuple(out)


def plan_slots(gpus: Sequence[Gpu], *, cpu_slots: int, spill: bool, group: int,
               classes: Sequence[SizeClass], host: str, gangs: bool = False) -> list[WorkerSlot]:
    """The worker processes to run: GPUs in groups of `group` (of one class), or with `gangs`
    one gang worker per GPU, which any of the host's GPU sets may be given; then CPU slots."""
    if group < 1:
        raise ConfigError("--group must be at least 1")
    if gangs and group != 1:
        raise ConfigError("--gangs places each job on the GPUs it asks for: leave out --group")
    if len(gpus) % group:
        raise ConfigError(f"--group {group}: {len(gpus)} GPUs do not split into groups of {group}")
    slots = []
    sets = gang_sets(gpus, spill=spill, classes=classes) if gangs and gpus else ()
    # A gang worker watches one GPU (its heartbeat relays that GPU's readings, an XID error on
    # it drains the worker and so takes the GPU out of the sets offered) but runs each job on
    # the GPUs its dispatch names; its monitor reads all of the host's, in index order.
    host_mem_gb = tuple(g.mem_gb for g in sorted(gpus, key=lambda g: g.index) if g.simulated)
    for g in gpus if sets else ():
        slots.append(WorkerSlot(node=f"gpu{g.index}@{host}", queues=(node_queue(host),),
                                gpus=str(g.index), gpu_count=1,
                                size_class=class_for_gpu(g.mem_gb, classes).name,
                                simulated_mem_gb=host_mem_gb, gang=sets))
    for start in range(0, 0 if sets else len(gpus), group):
        members = list(gpus[start:start + group])
        own = min((class_for_gpu(g.mem_gb, classes) for g in members), key=lambda c: c.gpu_mem_gb)
        queues = spill_queues(own, group, classes) if spill else [queue_name(own.name, group)]
        ids = [str(g.index) for g in members]
        slots.append(WorkerSlot(node=f"gpu{'-'.join(ids)}@{host}", queues=tuple(queues),
                                gpus=",".join(ids), gpu_count=group, size_class=own.name,
                                simulated_mem_gb=tuple(g.mem_gb for g in members
                                                       if g.simulated)))
    if cpu_slots:
        cpu = cpu_class(classes)
        if cpu is None:
            raise ConfigError("--cpu-slots: the configuration has no cpu size class")
        for i in range(cpu_slots):
            slots.append(WorkerSlot(node=f"cpu{i}@{host}", queues=(queue_name(cpu.name),), gpus="",
                                    gpu_count=0, size_class=cpu.name))
    if not slots:
        raise ConfigError("no GPUs found and no --cpu-slots: nothing to serve "
                          "(use --simulate-gpus 1x24 or --cpu-slots 1 on a machine without GPUs)")
    return slots


def default_host() -> str:
    return socket.gethostname()


class Launcher:
    """Supervises one worker process per slot."""

    def __init__(self, *, settings: Settings, slots: Sequence[WorkerSlot],
                 loglevel: str = "INFO", keep_drains: bool = False) -> None:
        self._settings = settings
        # keep_drains (`e31 up`'s launcher, which `e31 up` restarts): a node drained in the
        # store stays stopped, across restarts, until `e31 worker --undrain` removes the
        # request; the launcher then starts it again. Without it, starting clears the drains.
        self._keep_drains = keep_drains
        self._slots = list(slots)
        self._loglevel = loglevel
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._stop = threading.Event()
        self._redis: redis.Redis | None = None
        self._beat_failing = False
        self._releases: dict[str, threading.Thread] = {}

    def _spawn(self, slot: WorkerSlot) -> subprocess.Popen[bytes]:
        # --home and --isolation reach the workers
        env = dict(os.environ, E31_HOME=str(self._settings.home),
                   E31_ISOLATION=self._settings.isolation,
                   E31_WARM_START="1" if self._settings.warm_start else "0",
                   E31_PRELOAD=",".join(self._settings.preload))
        # Pinned before Python starts in the worker: it and its jobs see only these GPUs (a
        # gang worker none: each of its jobs is given its own in the child's environment).
        env.update(CUDA_VISIBLE_DEVICES="" if slot.gang else slot.gpus,
                   CUDA_DEVICE_ORDER="PCI_BUS_ID")
        argv = [sys.executable, "-m", "e31_worker.node.celery_process", "--node", slot.node,
                "--queues", ",".join(slot.queues), "--gpus", slot.gpus,
                "--gpu-count", str(slot.gpu_count), "--size-class", slot.size_class,
                "--loglevel", self._loglevel, "--host-slots", str(len(self._slots))]
        if slot.simulated_mem_gb:
            argv += ["--simulated-gpu-mem-gb", ",".join(f"{m:g}" for m in slot.simulated_mem_gb)]
        if slot.gang:
            argv += ["--gang", json.dumps([[gpus, list(queues)] for gpus, queues in slot.gang])]
        # If the launcher dies, its workers drain and exit instead of living on as orphans
        # that a restarted launcher would double on the same GPU.
        prctl = prctl_function()
        proc = subprocess.Popen(argv, env=env,
                                preexec_fn=lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM))
        log.info("worker_started node=%s pid=%d queues=%s CUDA_VISIBLE_DEVICES=%r", slot.node,
                 proc.pid, ",".join(slot.queues), slot.gpus)
        return proc

    def run(self) -> int:
        """Start every slot and supervise until SIGTERM/SIGINT; returns the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        drained = self._drains_at_start()
        backoff = {s.node: RESTART_BACKOFF_S for s in self._slots}
        started: dict[str, float] = {}
        restart_at: dict[str, float] = {}   # a dead slot's restart time: no slot waits for another
        self._start_all(drained, started, restart_at)
        undrain_check = time.monotonic() + UNDRAIN_POLL_S
        next_beat = 0.0
        while not self._stop.wait(SUPERVISE_POLL_S):
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self._settings.heartbeat_interval_s
                self._beat([s.node for s in self._slots if s.node not in drained])
            if self._keep_drains and drained and now >= undrain_check:
                undrain_check = now + UNDRAIN_POLL_S
                drained -= self._start_undrained(drained, started)
            for slot in self._slots:
                node = slot.node
                if node in restart_at:
                    if now >= restart_at[node] and not self._releasing(node):
                        del restart_at[node]
                        self._procs[node] = self._spawn(slot)
                        started[node] = now
                    continue
                if node in drained:
                    continue
                proc = self._procs[node]
                if proc.poll() is None:
                    continue
                if proc.returncode == EXIT_DRAINED:
                    log.warning("worker_drained node=%s: not restarted", node)
                    drained.add(node)
                    continue
                delay = self._restart_delay(proc.returncode, now - started[node], backoff, node)
                log.warning("worker_died node=%s code=%s; restarting in %.0f s", node,
                            proc.returncode, delay)
                # Its unfinished job runs again now, not once its successor beats; in a
                # thread, so that a slow store delays only this node's restart
                self._release(node, proc.returncode)
                restart_at[node] = now + delay
            if len(drained) == len(self._slots) and not self._keep_drains:
                log.warning("launcher_drained: every worker of this launcher was drained; exiting")
                break
        self.stop()
        return 0

    def _start_all(self, drained: set[str], started: dict[str, float],
                   restart_at: dict[str, float]) -> None:
        """Start each slot not drained, once what its node held in an earlier life is
        released (`_release_at_start`); a slot whose release is slow is started by the
        supervising loop once it is done."""
        nodes = [s.node for s in self._slots if s.node not in drained]
        self._beat(nodes)
        self._release_at_start(nodes)
        for slot in self._slots:
            if slot.node in drained:
                continue
            if self._releasing(slot.node):
                restart_at[slot.node] = time.monotonic()
            else:
                self._procs[slot.node] = self._spawn(slot)
                started[slot.node] = time.monotonic()

    def _release(self, node: str, exit_code: int | None, *, at_start: bool = False) -> None:
        """Release the jobs of `node`'s dead worker process (e31_worker.node.release)."""
        thread = threading.Thread(target=release_dead_worker, name=f"release-{node}",
                                  args=(self._settings, node),
                                  kwargs={"exit_code": exit_code, "redis_client": self._redis,
                                          "at_start": at_start},
                                  daemon=True)
        self._releases[node] = thread
        thread.start()

    def _release_at_start(self, nodes: list[str]) -> None:
        """Release what `nodes` held in an earlier life (a node that died whole and came back
        before the scheduler judged it silent: its new launcher's beat would otherwise keep
        those jobs to their leases), each in its thread, waiting `START_RELEASE_WAIT_S` for
        them together; a node whose release is slower starts once it is done."""
        for node in nodes:
            self._release(node, None, at_start=True)
        deadline = time.monotonic() + START_RELEASE_WAIT_S
        for node in nodes:
            self._releases[node].join(timeout=max(0.0, deadline - time.monotonic()))

    def _releasing(self, node: str) -> bool:
        """Whether `node`'s release still runs: its successor waits, as the release holds
        the node's lock."""
        thread = self._releases.get(node)
        return thread is not None and thread.is_alive()

    @staticmethod
    def _restart_delay(code: int, lived_s: float, backoff: dict[str, float], node: str) -> float:
        """A process that dies on its own soon after starting is in a crash loop: back off,
        doubling. One killed from outside (SIGKILL: an operator, the OOM killer) comes back
        at once, so that it settles the attempt it may have left (e31_worker.attempt.settle)
        within the job's lease."""
        if code == -signal.SIGKILL or lived_s >= QUICK_DEATH_S:
            backoff[node] = RESTART_BACKOFF_S
            return RESTART_BACKOFF_S
        delay = backoff[node]
        backoff[node] = min(delay * 2, RESTART_BACKOFF_MAX_S)
        return delay

    def _drains_at_start(self) -> set[str]:
        """Without keep_drains, clear the drains of this launcher's nodes (nothing stays
        drained); with it, the nodes drained in the store, left stopped."""
        if not self._keep_drains:
            self._clear_drain_requests()
            return set()
        drained = self._drained_in_store() or set()
        for node in sorted(drained):
            log.warning("worker_held_drained node=%s: drained in the store; not started until "
                        "`e31 worker --undrain`", node)
        return drained

    def _drained_in_store(self) -> set[str] | None:
        """This launcher's nodes with a live drain request in the store (an operator's or a
        GPU error's); None when the store cannot be read (nothing changes then)."""
        since = utcnow() - timedelta(seconds=DRAIN_REQUEST_TTL_S)
        try:
            repo = wiring.drain_store(self._settings)
            try:
                held = repo.drained_since(since=since)
            finally:
                repo.engine.dispose()
        except E31Error as exc:
            log.warning("drain_check_failed: store: %s", exc)
            return None
        return {s.node for s in self._slots if s.node in held}

    def _start_undrained(self, drained: set[str], started: dict[str, float]) -> set[str]:
        """Start the drained nodes whose request is gone (`e31 worker --undrain`); returns
        them."""
        held = self._drained_in_store()
        if held is None:
            return set()
        back = set()
        for slot in self._slots:
            if slot.node in drained and slot.node not in held:
                log.warning("worker_undrained node=%s: drain request gone; starting", slot.node)
                self._procs[slot.node] = self._spawn(slot)
                started[slot.node] = time.monotonic()
                back.add(slot.node)
        return back

    def _clear_drain_requests(self) -> None:
        """Starting again after a drain puts the nodes back in service: their requests go from
        the store and their keys from Redis, each tried even when the other fails."""
        nodes = [s.node for s in self._slots]
        try:
            repo = wiring.drain_store(self._settings)
            try:
                repo.clear_drain(nodes)
            finally:
                repo.engine.dispose()
        except E31Error as exc:
            log.warning("drain_clear_failed: store: %s", exc)
        if not self._settings.redis_url:
            return
        client = wiring.redis_client(self._settings)   # a sentinel:// URL too
        try:
            clear_drain(client, nodes)
        except redis.RedisError as exc:
            log.warning("drain_clear_failed: %s", exc)
        finally:
            client.close()

    def _beat(self, nodes: list[str]) -> None:
        """Say that this launcher lives, for `nodes` (module docstring); a Redis that fails
        is said once per run of failures, and the workers' own beats say the rest."""
        if not self._settings.redis_url or not nodes:
            return
        try:
            if self._redis is None:
                self._redis = wiring.redis_client(self._settings,
                                                  socket_timeout_s=BEAT_REDIS_TIMEOUT_S)
            beat_launcher(self._redis, nodes, interval_s=self._settings.heartbeat_interval_s)
        except redis.RedisError as exc:
            if not self._beat_failing:
                log.warning("launcher_beat_failed: %s", exc)
            self._beat_failing = True
            return
        self._beat_failing = False

    def stop(self) -> None:
        """Drain: SIGTERM every worker (running jobs get the grace period), then SIGKILL
        stragglers."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self._settings.kill_grace_s + STOP_EXTRA_S
        for node, proc in self._procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker_kill node=%s: did not stop in time", node)
                proc.kill()
                proc.wait()
