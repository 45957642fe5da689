"""Build every shared object from `Settings`, in one place, so that no caller forgets a
setting: the stores (`Repo`, their union, or the one noun a process uses), the Celery app,
the artifact store and Redis clients.

Entry points (the API factory, the scheduler, a worker process, the CLI, the local stack)
call these; nothing else constructs them from settings by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from e31.edge.settings import Settings
from e31.store import AttemptStore, DrainStore, Repo, SchedulingStore, make_engine
from e31.store.db import end_abandoned_transactions

# Redis, Celery and the artifact store are imported by the builders that make them: a CLI
# command that needs the store alone (e31 tenant) then does not pay ~0.3 s of imports it never
# uses.
if TYPE_CHECKING:
    import redis
    from celery import Celery
    from sqlalchemy import Engine

    from e31.edge.artifacts import ArtifactStore


def repo(settings: Settings, *, node: str | None = None) -> Repo:
    """Every store in one (the API, the CLI, the local stack),
    with the pool's fair-share half-life (the same in every process). A worker process passes
    its `node`: see `store_engine`."""
    return Repo(store_engine(settings, node=node), half_life_s=settings.fair_share_half_life_s)


def scheduling_store(settings: Settings) -> SchedulingStore:
    """The scheduler's store: what its leader reads and writes, nothing else of the store."""
    return SchedulingStore(store_engine(settings), half_life_s=settings.fair_share_half_life_s)


def attempt_store(settings: Settings, *, node: str) -> AttemptStore:
    """A worker process's store: its attempts' claim, renewal and outcome, nothing else of the
    store, on the engine of its `node` (`store_engine`)."""
    return AttemptStore(store_engine(settings, node=node),
                        half_life_s=settings.fair_share_half_life_s)


def drain_store(settings: Settings) -> DrainStore:
    """A launcher's store: its nodes' drain requests."""
    return DrainStore(store_engine(settings))


def store_engine(settings: Settings, *, node: str | None = None) -> Engine:
    """The engine of the results store. A worker process passes its `node` (`gpu0@host`): it
    keeps one connection (store/db.py), names itself `e31 worker <node>` to PostgreSQL, so
    pg_stat_activity counts a node's, and its abandoned transactions are ended."""
    if node is None:
        return make_engine(settings.resolved_database_url)
    return end_abandoned_transactions(make_engine(settings.resolved_database_url,
                                                  application_name=f"e31 worker {node}",
                                                  worker=True))


def artifacts(settings: Settings) -> ArtifactStore:
    from e31.edge.artifacts import ArtifactStore
    return ArtifactStore(settings.resolved_artifacts_url,
                         storage_options=storage_options(settings))


def storage_options(settings: Settings) -> dict[str, Any]:
    """s3fs's arguments for an `s3://` artifact store: the endpoint and the credentials of
    the E31_S3_* settings; what is unset is left to botocore (AWS_* variables, ~/.aws, an
    instance role). Nothing for any other store."""
    if not settings.resolved_artifacts_url.startswith("s3://"):
        return {}
    options: dict[str, Any] = {}
    if settings.s3_endpoint_url:
        options["endpoint_url"] = settings.s3_endpoint_url
    if settings.s3_access_key_id:
        options["key"] = settings.s3_access_key_id
    if settings.s3_secret_access_key:
        options["secret"] = settings.s3_secret_access_key
    return options


def redis_client(settings: Settings, *, socket_timeout_s: float | None = None,
                 connect_timeout_s: float | None = None) -> redis.Redis:
    """A client of the broker's Redis (the heartbeats, the wake-up list, drain requests). With
    a `sentinel://` URL, a client of the primary that Sentinel names: after a failover its
    next connection goes to the new primary. `socket_timeout_s` bounds each answer and
    `connect_timeout_s` each connection (None: wait as long as the OS does; a Redis that
    accepts and never answers, a stopped one, then holds the caller for ever)."""
    import redis
    from redis.sentinel import Sentinel
    if not is_sentinel(settings.redis_url):
        return redis.Redis.from_url(settings.redis_url, socket_timeout=socket_timeout_s,
                                    socket_connect_timeout=connect_timeout_s)
    hosts, db, password = sentinel_parts(settings.redis_url)
    sentinel = Sentinel(hosts, socket_timeout=SENTINEL_TIMEOUT_S)
    client: redis.Redis = sentinel.master_for(settings.redis_master_name, db=db,
                                              password=password,
                                              socket_timeout=socket_timeout_s,
                                              socket_connect_timeout=connect_timeout_s)
    return client


SENTINEL_TIMEOUT_S = 2.0   # one question to one sentinel


def is_sentinel(url: str) -> bool:
    return url.startswith("sentinel://")


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], int, str | None]:
    """The sentinels of `sentinel://[:pw@]h1:p1;sentinel://h2:p2/db` (kombu's form), the
    database number (the last part's path) and the primary's password (the first given)."""
    hosts: list[tuple[str, int]] = []
    db, password = 0, None
    for part in url.split(";"):
        p = urlsplit(part.strip())
        if p.scheme != "sentinel" or not p.hostname:
            raise ValueError(f"not a sentinel URL: {part!r}")
        hosts.append((p.hostname, p.port or 26379))
        if p.path.strip("/"):
            db = int(p.path.strip("/"))
        password = password or (unquote(p.password) if p.password else None)
    return hosts, db, password


def celery(settings: Settings, *, queues: list[str] | None = None) -> Celery:
    from e31.edge.celeryapp import make_celery
    return make_celery(settings, queues=queues)
