"""Build every shared object from `Settings`, in one place, so that no caller forgets a
setting: the store's `Repo`, the Celery app, the artifact store and Redis clients.

Entry points (the API factory, the scheduler, a worker process, the CLI, the local stack)
call these; nothing else constructs them from settings by hand.
"""

from __future__ import annotations

import redis
from celery import Celery

from e31.artifacts import ArtifactStore
from e31.celeryapp import make_celery
from e31.settings import Settings
from e31.store import Repo, make_engine


def repo(settings: Settings) -> Repo:
    """The store, with the pool's fair-share half-life (the same in every process)."""
    return Repo(make_engine(settings.resolved_database_url),
                half_life_s=settings.fair_share_half_life_s)


def artifacts(settings: Settings) -> ArtifactStore:
    return ArtifactStore(settings.resolved_artifacts_url)


def redis_client(settings: Settings, *, socket_timeout_s: float | None = None) -> redis.Redis:
    """A client of the broker's Redis (the heartbeats, the wake-up list, drain requests)."""
    return redis.Redis.from_url(settings.redis_url, socket_timeout=socket_timeout_s)


def celery(settings: Settings, *, queues: list[str] | None = None) -> Celery:
    return make_celery(settings, queues=queues)
