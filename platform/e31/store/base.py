"""What every store shares: one engine, and the short transactions it opens on it.

Each noun has its store (`JobStore`, `AttemptStore`, `ArrayStore`, `TenantStore`,
`SchedulingStore`, `PoolStore`, `DrainStore`), each a full class built from an engine alone
(`BillingStore`s also take the fair-share half-life); `Repo` is their union for the
processes that use them all. A store that needs another noun's work calls that noun's store
(a whole call, built on the same engine), or, inside its own transaction, that noun's named
statement function (`attempts.end_attempt`, `jobs.find_job`), never a stub of it.

Reads and writes are short transactions. On SQLite a write transaction starts with
`BEGIN IMMEDIATE` (see `db.py`), so concurrent writers wait instead of failing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from e31.core.errors import StoreError, StoreUnavailable
from e31.store import deps
from e31.store.db import WRITE_OPTION


class Store:
    """One engine and its transactions: the base of every store."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine(self) -> Engine:
        return self._engine

    @contextmanager
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        """One transaction, committed when the block ends; a write one with `write` (SQLite:
        `BEGIN IMMEDIATE`). The driver's errors come out as the store's own."""
        with _store_errors(), Session(self._engine, expire_on_commit=False) as s, s.begin():
            s.connection(execution_options={WRITE_OPTION: write})
            yield s

    @contextmanager
    def _core(self, *, write: bool = False) -> Iterator[Connection]:
        """`_session`'s transaction on a bare connection, for Core statements alone (no ORM
        object loaded or written): the session's own work per transaction, and the ORM's per
        statement, were a third of a scheduler tick's CPU (issue 31)."""
        with _store_errors(), self._engine.connect() as c:
            c.execution_options(**{WRITE_OPTION: write})
            with c.begin():
                yield c

    def _check_after(self, tenant_id: str, after: Sequence[Sequence[str]],
                     fields: Sequence[str]) -> list[list[str]]:
        """`deps.check_after` on a read session of its own, before a submit's write transaction
        opens (none when no job has dependencies). One method for a job's submit and an
        array's, so both take the same path between the check and the write."""
        if not any(after):
            return [[] for _ in after]
        with self._session() as s:
            return deps.check_after(s, tenant_id, after, fields)


@contextmanager
def _store_errors() -> Iterator[None]:
    """The driver's errors as the store's own: unavailable (the database cannot be reached or
    is locked too long), or an error; an integrity error is the caller's to catch."""
    try:
        yield
    except OperationalError as exc:
        raise StoreUnavailable(f"results store unavailable: {exc.orig}") from exc
    except IntegrityError:
        raise
    except SQLAlchemyError as exc:
        raise StoreError(f"results store error: {type(exc).__name__}: {exc}") from exc


class BillingStore(Store):
    """A store whose writes end attempts, and so bill each one to its tenant's decayed usage:
    with `half_life_s`, the pool's `fair_share_half_life_s`, the same in every process, so it
    has no default here (`e31.edge.wiring` builds the stores from settings)."""

    def __init__(self, engine: Engine, *, half_life_s: float) -> None:
        super().__init__(engine)
        self._half_life_s = half_life_s
