"""`make_celery(settings)`: the Celery app every E31 process shares (docs/operations.md,
"Celery settings that matter")."""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from e31.core.sizeclasses import queue_name
from e31.edge.settings import Settings

TASK_NAME = "e31.run"
PRIORITY_STEPS = list(range(10))
BROKER_SOCKET_TIMEOUT_S = 15
BROKER_CONNECT_TIMEOUT_S = 5
BROKER_HEALTH_CHECK_S = 10


def broker_transport_options(settings: Settings) -> dict[str, object]:
    """Identical in every process that publishes or consumes (workers, scheduler, Flower)."""
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        "priority_steps": PRIORITY_STEPS,
        "sep": ":",
        "queue_order_strategy": "priority",
        # A broker that vanishes without closing the connection (a cut link) must not leave a
        # publish or an ack waiting for ever; above the 1 s BRPOP of the consumers.
        "socket_timeout": BROKER_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": BROKER_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "health_check_interval": BROKER_HEALTH_CHECK_S,
        # kombu's sentinel:// transport asks Sentinel for this primary (docs/operations.md)
        **({"master_name": settings.redis_master_name}
           if settings.redis_url.startswith("sentinel://") else {}),
    }


def make_celery(settings: Settings, *, queues: list[str] | None = None) -> Celery:
    """A Celery app for `settings`; nothing connects until it is used."""
    app = Celery("e31", broker=settings.redis_url, set_as_current=False)
    names = queues or [queue_name(c.name) for c in settings.size_classes]
    app.conf.update(
        accept_content=["json"],
        task_serializer="json",
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=False,  # the lease and the claim recover, not a redelivery
        worker_prefetch_multiplier=1,
        # Events cost 4 of 5 Redis PUBLISH per job; only a Flower reads them (settings)
        worker_send_task_events=settings.celery_events == "always",
        task_send_sent_event=settings.celery_events == "always",
        worker_hijack_root_logger=False,
        broker_transport_options=broker_transport_options(settings),
        broker_connection_retry_on_startup=True,
        task_default_queue=names[0],
        task_queues=[Queue(n, routing_key=n) for n in names],
        task_create_missing_queues=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        enable_utc=True,
    )
    return app
