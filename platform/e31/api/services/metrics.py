"""The pool's Prometheus series for `GET /metrics` (`e31.core.metrics` names them, `e31.ops.scrape`
reads them from the store and Redis at each scrape, so every API replica answers the same;
docs/operations.md, "Monitoring"). The route and its guard are `e31.api.routes.metrics`.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import redis

from e31.edge.settings import Settings
from e31.ops import scrape

CONTENT_TYPE = scrape.CONTENT_TYPE   # of what `text` answers


class MetricsService:
    """One registry of the pool's series over the store reads and Redis of the API."""

    def __init__(self, *, settings: Settings, reads: scrape.PoolReads,
                 redis_client: redis.Redis) -> None:
        artifacts = urlsplit(settings.resolved_artifacts_url)
        self._registry = scrape.registry(scrape.PoolCollector(
            reads=reads, redis_client=redis_client,
            classes=[c.name for c in settings.size_classes], window_s=settings.metrics_window_s,
            artifacts_dir=Path(artifacts.path) if artifacts.scheme == "file" else None))

    def text(self) -> bytes:
        """The series now, in Prometheus's text format (`CONTENT_TYPE`)."""
        return scrape.render(self._registry)

