"""The SQL results store: models, the repository, migrations."""

from e31.store.db import make_engine
from e31.store.repo import Repo

__all__ = ["Repo", "make_engine"]
