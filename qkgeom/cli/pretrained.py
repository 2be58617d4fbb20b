"""CLI commands (pretrained); owner fills in."""

from __future__ import annotations
