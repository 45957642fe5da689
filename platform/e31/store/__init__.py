"""The SQL results store: models, migrations, one store per noun and `Repo`, their union."""

from e31.store.arrays import ArrayStore
from e31.store.attempts import AttemptStore
from e31.store.db import make_engine
from e31.store.drains import DrainStore
from e31.store.jobs import JobStore
from e31.store.pool import PoolStore
from e31.store.repo import Repo
from e31.store.scheduling import SchedulingStore
from e31.store.tenants import TenantStore

__all__ = ["ArrayStore", "AttemptStore", "DrainStore", "JobStore", "PoolStore", "Repo",
           "SchedulingStore", "TenantStore", "make_engine"]
