"""Bulk inserts prepared before the write transaction opens, so that it only executes them.

Executing an INSERT of many rows, SQLAlchemy applies each column's bind processing (JSON,
UTC datetimes) to every row, and SQLite's driver steps once per row, giving up Python's
interpreter lock each time: for an array of 10,000 items in a busy API process, most of the
time spent inside the write transaction, and on SQLite inside the store's one write lock.
`prepare` does the processing first, with no transaction open, and for SQLite packs the rows
into multi-row INSERTs of as many rows as one statement may bind, so `Prepared.run` executes
a few statements instead of 10,000 (docs/reliability.md, "No request can lock the store").
"""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Dialect, insert
from sqlalchemy.orm import Session

from e31.store.db import core_of
from e31.store.models import Base

# Host parameters one SQLite statement may bind: SQLITE_MAX_VARIABLE_NUMBER's default since
# SQLite 3.32, 999 before it.
SQLITE_VARIABLES_MAX = 32_766 if sqlite3.sqlite_version_info >= (3, 32) else 999

Params = tuple[Any, ...] | Mapping[str, Any]


@dataclass(frozen=True)
class Prepared:
    """INSERT statements for one driver, each with its parameters as the driver takes them:
    one tuple for a multi-row statement (SQLite), or a list of rows for one `executemany`
    that the driver batches itself (psycopg)."""

    statements: Sequence[tuple[str, tuple[Any, ...] | Sequence[Params]]]

    def run(self, s: Session | Connection) -> None:
        """Insert the rows in the session's (or the connection's) transaction."""
        conn = core_of(s)
        for sql, params in self.statements:
            conn.exec_driver_sql(sql, params)


def prepare(dialect: Dialect, model: type[Base], rows: Sequence[Mapping[str, Any]]) -> Prepared:
    """`rows`, each with the same keys, as `dialect`'s driver inserts them into `model`'s
    table.

    A column missing from the rows gets its server default or NULL; one with a Python-side
    default must be given, since nothing computes it here (`ValueError` otherwise)."""
    if not rows:
        return Prepared([])
    keys = list(rows[0])
    compiled = insert(model).compile(dialect=dialect, column_keys=keys)
    if compiled.insert_prefetch:
        names = ", ".join(column.name for column in compiled.insert_prefetch)
        raise ValueError(f"a bulk insert into {model.__tablename__} must give {names}")
    order = list(compiled.positiontup or ()) if compiled.positional else keys
    steps = [(key, model.__table__.c[key].type.dialect_impl(dialect).bind_processor(dialect))
             for key in order]
    if not compiled.positional:
        return Prepared([(compiled.string, [
            {key: process(row[key]) if process else row[key] for key, process in steps}
            for row in rows])])
    values = [tuple(process(row[key]) if process else row[key] for key, process in steps)
              for row in rows]
    if dialect.paramstyle != "qmark":
        return Prepared([(compiled.string, values)])
    head, _, group = compiled.string.rpartition(" VALUES ")
    per_statement = max(1, SQLITE_VARIABLES_MAX // len(order))
    batches = (values[start:start + per_statement]
               for start in range(0, len(values), per_statement))
    return Prepared([(f"{head} VALUES {', '.join([group] * len(batch))}",
                      tuple(itertools.chain.from_iterable(batch))) for batch in batches])
