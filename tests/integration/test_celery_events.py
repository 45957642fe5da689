"""Celery's task events follow whether a Flower is in use (docs/operations.md, "Celery's task
events"): a real Celery worker of the pool's app, started as the pool's are (threads, Celery's
worker heartbeat on), on a real Redis, sends none until Celery's
`enable_events` (what a running Flower broadcasts every 5 s) asks, and then sends them;
`celery_events = always` sends them from the first, the scheduler's `task-sent` too."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from celery.contrib.testing.worker import start_worker

from e31.edge.celeryapp import make_celery
from e31.edge.settings import Settings
from tests.conftest import wait_for

QUEUE = "e31.cpu"


class Events:
    """Every Celery event on the app's broker, captured by a real receiver in a thread."""

    def __init__(self, app) -> None:  # type: ignore[no-untyped-def]
        self.seen: list[str] = []
        self._app = app
        self._receiver = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self._app.connection_for_read() as conn:
            self._receiver = self._app.events.Receiver(
                conn, handlers={"*": lambda event: self.seen.append(event["type"])})
            self._ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def tasks(self) -> list[str]:
        return [t for t in self.seen if t.startswith("task-")]

    @contextmanager
    def running(self) -> Iterator[Events]:
        self._thread.start()
        self._ready.wait(10)
        time.sleep(1.0)                     # the receiver has subscribed
        try:
            yield self
        finally:
            if self._receiver is not None:
                self._receiver.should_stop = True
            self._thread.join(5)


def pool_app(redis_url: str, events: str):  # type: ignore[no-untyped-def]
    app = make_celery(Settings(redis_url=redis_url, celery_events=events))
    app.conf.update(worker_hijack_root_logger=False)

    @app.task(name=f"e31.test_noop_{events}")
    def noop() -> str:
        return "ok"

    return app, noop


@contextmanager
def watched_worker(app) -> Iterator[Events]:  # type: ignore[no-untyped-def]
    """A real worker of `app`, started as the pool's are (threads, Celery's worker heartbeat
    on), and a receiver of every event on its broker."""
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                      queues=[QUEUE], loglevel="WARNING", without_heartbeat=False), \
            Events(app).running() as events:
        yield events


def run_tasks(app, noop, n: int) -> None:  # type: ignore[no-untyped-def]
    """Send n tasks and wait until the worker ran them (its `active` is empty again)."""
    for _ in range(n):
        noop.apply_async(queue=QUEUE)
    wait_for(lambda: app.connection().default_channel.client.llen(QUEUE) == 0, timeout_s=30,
             what="the worker to take the tasks")
    time.sleep(1.0)      # their events, if any, are in flight


def test_a_worker_sends_no_task_events_until_a_flower_asks_for_them(redis_url: str) -> None:
    # Given the pool's app with the default (events follow Flower) and a real worker
    app, noop = pool_app(redis_url, "flower")
    with watched_worker(app) as events:
        # When tasks run with no Flower about
        run_tasks(app, noop, 3)
        # Then no task event was sent: neither the worker's nor the sender's task-sent
        assert events.tasks() == []

        # When a Flower asks (it broadcasts Celery's enable_events every 5 s)
        app.control.enable_events()
        time.sleep(0.5)
        run_tasks(app, noop, 2)
        # Then the worker's task events follow
        wait_for(lambda: "task-succeeded" in events.tasks(), timeout_s=10,
                 what="task events once enabled")
        assert "task-sent" not in events.tasks()


def test_celery_events_always_sends_them_from_the_first_the_senders_too(redis_url: str) -> None:
    # Given the pool's app with celery_events = always (what `e31 up` sets when it runs Flower)
    app, noop = pool_app(redis_url, "always")
    with watched_worker(app) as events:
        # When tasks run
        run_tasks(app, noop, 2)
        # Then their events were sent, the sender's task-sent among them
        wait_for(lambda: "task-succeeded" in events.tasks(), timeout_s=10, what="task events")
        assert "task-sent" in events.tasks()
