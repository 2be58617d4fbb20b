"""CLI commands (stats); owner fills in."""

from __future__ import annotations
