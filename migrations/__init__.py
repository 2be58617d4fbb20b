"""Alembic migrations of the qkgeom results database (installed as ``qkgeom.migrations``)."""
