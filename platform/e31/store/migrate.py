"""`upgrade(engine)`: bring the store's schema to the newest Alembic revision."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from e31.core.errors import StoreUnavailable

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply every migration up to `revision`; safe to run again and from several processes."""
    try:
        command.upgrade(alembic_config(engine), revision)
    except OperationalError as exc:
        raise StoreUnavailable(f"cannot migrate the results store: {exc.orig}") from exc
