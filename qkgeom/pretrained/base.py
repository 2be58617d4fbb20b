"""What every part of :mod:`qkgeom.pretrained` shares: its error, defaults and result type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qkgeom.errors import QkgeomError
from qkgeom.records import Row

# Per-revision progress of a measurement: (tokens done, tokens total, info such as
# tokens_per_s). Not tune.Progress, the sweep's Tune callback.
TokenProgress = Callable[[int, int, dict], None]

DEFAULT_MAX_TOKENS = 131_072
DEFAULT_SEQ_LEN = 256  # the paper's context; entropy grows with the keys visible
DEFAULT_CHUNK_TOKENS = 4096
DEFAULT_ERANK_SEQS = 8  # sequences entering token_erank (a d_head-sized SVD per head each)


class PretrainedError(QkgeomError):
    """A pretrained model, checkpoint or text could not be loaded or measured."""


@dataclass
class Measurement:
    rows: list[Row]
    meta: dict[str, Any]
