"""CLI commands (sweep); owner fills in."""

from __future__ import annotations
