"""The results database: the only storage code in qkgeom.

    from qkgeom.store import open_store
    with open_store("sqlite:///runs/study.db") as store:
        sid = store.ensure_sweep("cpu-grid", spec, code_version)
        tid = store.ensure_trial(sid, "d4-gaussian-none-s0", cfg.to_dict(), depth=4,
                                 init="gaussian", arm="none", seed=0)
        store.set_trial_status(tid, "running", bump_attempts=True)
        store.write_probe(tid, record)
        df = store.sql("SELECT * FROM v_final WHERE metric = 'pr_q'")

The :class:`Store` is assembled in :mod:`~qkgeom.store.store` from its plumbing
(:mod:`~qkgeom.store.base`), result writes (:mod:`~qkgeom.store.writes`) and reads
(:mod:`~qkgeom.store.reads`); the study's read-side queries over the views are named
functions in :mod:`~qkgeom.store.queries`; ``qkgeom query`` runs in
:mod:`~qkgeom.store.readonly`.

URLs: ``--db`` / ``$QKGEOM_DB`` / ``sqlite:///qkgeom.db`` (:func:`resolve_url`). Schema and
units: docs/schema.md. Migrations: ``migrations/`` (installed as ``qkgeom.migrations``).
"""

from __future__ import annotations

from qkgeom.store.engine import (
    DEFAULT_URL,
    DatabaseError,
    UrlError,
    resolve_url,
    safe_url,
)
from qkgeom.store.models import STATUSES, TABLES, VIEWS
from qkgeom.store.schema import SchemaError, SchemaState, current, head_revision, upgrade
from qkgeom.store.store import ReadOnlyError, Store, TrialInfo, open_store, read_sql

__all__ = [
    "DEFAULT_URL",
    "STATUSES",
    "TABLES",
    "VIEWS",
    "DatabaseError",
    "ReadOnlyError",
    "SchemaError",
    "SchemaState",
    "Store",
    "TrialInfo",
    "UrlError",
    "current",
    "head_revision",
    "open_store",
    "read_sql",
    "resolve_url",
    "safe_url",
    "upgrade",
]
