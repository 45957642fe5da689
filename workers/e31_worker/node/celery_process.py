"""One pinned Celery worker process: `python -m e31_worker.node.celery_process --node ... --queues ...`.

The launcher starts it with `CUDA_VISIBLE_DEVICES` already set, and it never calls CUDA.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from celery import signals
from e31 import wiring
from e31.settings import Settings

from e31_worker.attempt.settle import settle_left_attempts
from e31.heartbeat import WorkerInfo

from e31_worker.node.runtime import WorkerRuntime
from e31_worker.attempt.task import register

EXIT_NODE_TAKEN = 3  # the launcher retries with back-off: the node may free up
EXIT_DRAINED = 4     # an operator drained this node: the launcher does not restart it


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="e31_worker.node.celery_process")
    parser.add_argument("--node", required=True)
    parser.add_argument("--queues", required=True, help="comma-separated, own class first")
    parser.add_argument("--gpus", default="")
    parser.add_argument("--gpu-count", type=int, default=0)
    parser.add_argument("--size-class", required=True)
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.loglevel, format=f"%(asctime)s {args.node} %(name)s %(levelname)s %(message)s")
    settings = Settings.load()
    queues = tuple(args.queues.split(","))
    identity = WorkerInfo(node=args.node, queues=queues, gpus=args.gpus,
                              gpu_count=args.gpu_count, size_class=args.size_class)
    runtime = WorkerRuntime(settings=settings, identity=identity,
                            repo=wiring.repo(settings), artifacts=wiring.artifacts(settings),
                            redis_client=wiring.redis_client(settings))
    taken_by = runtime.node_lock.acquire()
    if taken_by is not None:
        logging.getLogger(__name__).error(
            "node_taken node=%s pid=%d: another worker process serves this node name; give each "
            "`e31 worker` on a host its own --gpus or --hostname", args.node, taken_by)
        sys.exit(EXIT_NODE_TAKEN)
    runtime.groups.reap()              # what a dead predecessor's jobs left running
    settle_left_attempts(runtime)      # what it finished but could not record
    app = wiring.celery(settings, queues=list(queues))
    register(app, runtime)

    def _ready(**_: Any) -> None:
        runtime.start()

    def _shutting_down(**_: Any) -> None:
        runtime.stop()  # running job: SIGTERM, grace, requeued as `drained`

    signals.worker_ready.connect(_ready, weak=False)
    signals.worker_shutting_down.connect(_shutting_down, weak=False)
    # An operator's drain takes Celery's own warm-shutdown path, exactly as SIGTERM does.
    runtime.on_drain = lambda: os.kill(os.getpid(), signal.SIGTERM)
    try:
        app.worker_main(["worker", "--pool", "threads", "--concurrency", "1", "--hostname", args.node,
                         "--queues", ",".join(queues), "--loglevel", args.loglevel,
                         "--without-gossip", "--without-mingle", "--task-events"])
    finally:
        if runtime.drain_requested.is_set():
            logging.getLogger(__name__).warning("worker_drained node=%s", args.node)
            sys.exit(EXIT_DRAINED)


if __name__ == "__main__":
    main(sys.argv[1:])
