"""`Repo`: every store of E31 Batch in one object, for the processes that use them all.

The API, the CLI on the store, the local stack and the tests hold a `Repo`; a process that
needs one noun is given that noun's store alone (`e31.edge.wiring`: the scheduler a
`SchedulingStore`, the worker an `AttemptStore`). Each store is a full class on its own,
built from an engine (base.py); `Repo` only inherits them, so its methods are theirs:

- `JobStore` (jobs.py): submit, read, cancel, usage, retention.
- `ArrayStore` (arrays.py): arrays and fan-outs.
- `TenantStore` (tenants.py): tenants, tokens, secrets, outputs quotas, the audit log.
- `SchedulingStore` (scheduling.py): the leader's reads and writes, the explanations' reads.
- `PoolStore` (pool.py): the metrics' and `e31 top`'s reads.
- `DrainStore` (drains.py): nodes' drain requests.
- `BatchStore` (batches.py): the OpenAI-compatible files and batches, and the models.
- `AttemptStore` (attempts.py): the worker's claim, renewal, outcome, checks and notes.

`AttemptStore` comes last: the other nouns' calls it passes on to their stores (an array's
manifest, drain requests) resolve to those stores' own methods here.
"""

from __future__ import annotations

from e31.store.arrays import ArrayStore
from e31.store.attempts import AttemptStore
from e31.store.batches import BatchStore
from e31.store.drains import DrainStore
from e31.store.jobs import JOB_ID, JobStore
from e31.store.pool import PoolStore
from e31.store.scheduling import SchedulingStore
from e31.store.tenants import TenantStore
from e31.store.tokens import TOKEN_PREFIX, hash_token

__all__ = ["JOB_ID", "TOKEN_PREFIX", "Repo", "hash_token"]


class Repo(JobStore, ArrayStore, TenantStore, SchedulingStore, PoolStore, DrainStore,
           BatchStore, AttemptStore):
    """All database access, over one engine: `Repo(engine, half_life_s=...)`, the
    fair-share half-life with which ended attempts bill their tenants (`BillingStore`;
    `e31.edge.wiring.repo` builds a Repo from settings)."""
