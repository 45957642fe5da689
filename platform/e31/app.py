"""`celery -A e31.app …`: the pool's one Celery app, for the operator's usual Celery tools
(`inspect ping`, `inspect active`, `events`, `status`).

Importing this module builds nothing and reads nothing: the module's `app`, which Celery's
`-A` looks up, is built from `Settings` (flag-less: `E31_*` and the config file, as every
process reads them) on first use, by `make_celery`, the same function the workers, the
scheduler and Flower use, so it speaks to the workers over the same broker with the same
transport options. Without `E31_REDIS_URL` it finds the Redis of the `e31 up` running from
`E31_HOME`. docs/operations.md, "Celery's own tools".
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Celery

# `app` is built on first use by the module's __getattr__ below.


@functools.cache
def build() -> Celery:
    """The Celery app of the pool these settings name (one per process, built once)."""
    from e31.core.errors import ConfigError
    from e31.edge.celeryapp import make_celery
    from e31.edge.settings import Settings
    settings = Settings.load()
    if not settings.redis_url:
        from e31.local.state import stack_redis_url
        url = stack_redis_url(settings.home)
        if url is None:
            raise ConfigError("E31_REDIS_URL is not set and no `e31 up` runs from E31_HOME: "
                              "celery -A e31.app needs the pool's Redis")
        settings = settings.model_copy(update={"redis_url": url})
    return make_celery(settings)


def __getattr__(name: str) -> Any:
    if name == "app":
        return build()
    raise AttributeError(name)
