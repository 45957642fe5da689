"""`upgrade(engine)`: bring the store's schema to the newest Alembic revision.

A store already at the newest revision is left as it is without importing Alembic: every
operator command (`e31 tenant`, `e31 gc`) upgrades first, and Alembic's import alone cost each
of them about 0.2 s on a store that had nothing to apply. The newest revision is read from the
migrations' own `revision =` lines (`script_heads`; a test holds it equal to Alembic's).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from e31.core.errors import StoreUnavailable

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_REVISION_LINE = re.compile(r"^(revision|down_revision)\s*=\s*(.+?)\s*$", re.MULTILINE)


def alembic_config(engine: Engine) -> Config:
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply every migration up to `revision`; safe to run again and from several processes."""
    try:
        if revision == "head" and stored_revisions(engine) == script_heads():
            return
        from alembic import command
        command.upgrade(alembic_config(engine), revision)
    except OperationalError as exc:
        raise StoreUnavailable(f"cannot migrate the results store: {exc.orig}") from exc


def script_heads() -> set[str]:
    """The newest revisions of the migrations directory: those no migration names as its
    `down_revision` (what Alembic's `ScriptDirectory.get_heads()` finds)."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        fields = {k: ast.literal_eval(v) for k, v in _REVISION_LINE.findall(path.read_text())}
        revisions.add(fields["revision"])
        down = fields.get("down_revision")
        parents.update(down if isinstance(down, tuple) else [down] if down else [])
    return revisions - parents


def stored_revisions(engine: Engine) -> set[str]:
    """The revisions the store says it is at (none on a fresh store, whose `alembic_version`
    table does not exist yet)."""
    try:
        with engine.connect() as conn:
            return {row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))}
    except (OperationalError, ProgrammingError) as exc:
        if "alembic_version" in str(exc.orig):   # no such table: nothing applied yet
            return set()
        raise
