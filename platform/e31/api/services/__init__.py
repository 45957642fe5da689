"""The operations behind the routes, one service per noun, each scoped to the caller's tenant:

- `jobs` (`JobService`): submit and its dry run, read (with the long poll), list, cancel, logs
  and outputs; a footage fan-out through `fanout` (`FanoutService`);
- `arrays` (`ArrayService`): submit N jobs as one, read, cancel, retry, manifest;
- `bundles` (`BundleService`): upload and look up a tenant's bundles;
- `tokens` (`TokenService`): who a token names, and a tenant's own tokens;
- `tenants` (`TenantService`): the admin API, tenants and the audit log;
- `secrets` (`SecretService`): a tenant's secrets, sealed with the pool's key;
- `files`, `batches`, `models` (`FileService`, `BatchService`, `ModelService`): OpenAI's Files
  and Batch APIs as adapters over bundles and arrays, and the models batches name; `batch_ends`
  (`BatchEnds`) moves batches on as their shards run;
- `queue`, `usage`, `top`, `metrics`: the shared pool as a tenant, an admin or Prometheus may
  see it.

A submission, of a job, an array or a fan-out, is one pipeline (`submission.Submission`):
limits → bundles → secrets → placement → insert. `Services` builds every service from the
settings, the store, the artifact store and Redis; nothing here is global.
"""

from __future__ import annotations

import redis

from e31.api.services.arrays import ArrayService
from e31.api.services.batchends import BatchEnds
from e31.api.services.batches import BatchService
from e31.api.services.bundles import BundleService
from e31.api.services.fanout import FanoutService
from e31.api.services.files import FileService
from e31.api.services.jobs import JobService
from e31.api.services.metrics import MetricsService
from e31.api.services.models import ModelService
from e31.api.services.queue import QueueService
from e31.api.services.readings import PoolReadings
from e31.api.services.requirements import RequirementsCheck
from e31.api.services.secrets import SecretService
from e31.api.services.submission import Submission
from e31.api.services.tenants import TenantService
from e31.api.services.tokens import TokenService
from e31.api.services.top import TopService
from e31.api.services.usage import UsageService
from e31.api.waits import JobEnds
from e31.edge.artifacts import ArtifactStore
from e31.edge.bundlestore import BundleStore
from e31.edge.filestore import FileStore
from e31.edge.settings import Settings
from e31.store import Repo


class Services:
    """Every service of the API over one store, artifact store and Redis (one per process:
    the pool's readings and the long polls' listener are shared by its services)."""

    def __init__(self, *, settings: Settings, repo: Repo, artifacts: ArtifactStore,
                 redis_client: redis.Redis) -> None:
        self.repo = repo             # what every service is built over
        self.artifacts = artifacts
        self.redis = redis_client
        store = BundleStore(artifacts.url, artifacts.storage_options)
        readings = PoolReadings(settings=settings, repo=repo, redis_client=redis_client)
        self.bundles = BundleService(settings=settings, store=store)
        steps = Submission(settings=settings, repo=repo, redis_client=redis_client,
                           bundles=self.bundles, requirements=RequirementsCheck(store=store),
                           readings=readings)
        self.job_ends = JobEnds(redis_client)
        self.jobs = JobService(
            settings=settings, repo=repo, artifacts=artifacts, steps=steps, readings=readings,
            fanout=FanoutService(settings=settings, repo=repo, steps=steps), ends=self.job_ends)
        self.arrays = ArrayService(repo=repo, steps=steps)
        self.tokens = TokenService(repo=repo)
        self.tenants = TenantService(repo=repo)
        self.secrets = SecretService(settings=settings, repo=repo)
        self.queue = QueueService(settings=settings, repo=repo, readings=readings)
        self.usage = UsageService(repo=repo)
        self.top = TopService(settings=settings, reads=repo, redis_client=redis_client)
        self.metrics = MetricsService(settings=settings, reads=repo, redis_client=redis_client)
        self.files = FileService(settings=settings, repo=repo,
                                 store=FileStore(artifacts.url, artifacts.storage_options))
        self.batch_ends = BatchEnds(repo=repo, artifacts=artifacts, bundles=store,
                                    shard_max_bytes=settings.batch_file_max_bytes,
                                    files=self.files, settle_s=settings.batch_settle_s)
        self.batches = BatchService(settings=settings, repo=repo, files=self.files, bundles=store,
                                    arrays=self.arrays, ends=self.batch_ends)
        self.models = ModelService(settings=settings, repo=repo)


__all__ = ["Services"]
