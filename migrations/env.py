"""Alembic environment for the qkgeom results database.

qkgeom runs migrations through :mod:`qkgeom.store.schema`, which passes an open
connection (inside a locked transaction) as ``config.attributes["connection"]``. Run by
hand (``alembic -c migrations/alembic.ini -x db=URL ...``) it connects itself.
``render_as_batch`` on SQLite, whose ALTER TABLE cannot change most things in place.
"""

from __future__ import annotations

from alembic import context

from qkgeom.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    from qkgeom.store.engine import resolve_url

    return resolve_url(context.get_x_argument(as_dictionary=True).get("db"))


def _configure(**kw: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        **kw,
    )


def run_offline() -> None:
    url = _url()
    _configure(url=url, literal_binds=True, render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        _configure(connection=conn, render_as_batch=conn.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()
        return
    from qkgeom.store.engine import make_engine

    engine = make_engine(_url(), foreign_keys=False)
    try:
        with engine.connect() as conn:
            conn.execution_options(qkgeom_write=True)
            _configure(connection=conn, render_as_batch=conn.dialect.name == "sqlite")
            with conn.begin():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
