"""CLI commands (db); owner fills in."""

from __future__ import annotations
