"""What the sweep driver shares with its Tune callbacks and signal handlers, in one object.

Tune pickles the whole ``RunConfig`` (callbacks included) into the experiment state and
brings the callbacks back from that pickle on restore, so the callbacks hold no engine and
no database URL (it may carry a password). What they need from the running sweep lives in
:data:`DRIVER_STATE`, a :class:`DriverState` in the driver process only: callbacks read it
through the module, never hold it, and it refuses to be pickled.

:func:`qkgeom.sweeps.driver.run_sweep` calls :meth:`DriverState.reset` first thing, so a
second sweep in the same process starts from the defaults (no stale signal, finished keys
or callback error of the one before).

The local Ray instance's own bookkeeping (its scratch dir and processes) is not sweep
state: it outlives a sweep and is shared with other Ray users of the process, and lives
in :mod:`qkgeom.sweeps.ray_session`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from qkgeom.store.lifecycle import HEARTBEAT_S


@dataclass
class DriverState:
    """The running sweep, as the driver's callbacks and signal handlers see it."""

    # the sweep's database; the callbacks open their own store from it (never pickled)
    db_url: str | None = None
    # the Tune storage root; checkpoint locations are recorded relative to it
    storage: str | None = None
    # database_info.identity of that database: stamped in the experiment directories
    db_identity: str | None = None
    # the driver's printer (silent with ``quiet``)
    say: Callable[..., None] = print
    # seconds between heartbeats of the running trials (qkgeom.store.lifecycle)
    heartbeat_s: float = HEARTBEAT_S
    # the whole plan, trial key -> max_steps: the progress line's totals
    plan_steps: dict[str, int] = field(default_factory=dict)
    # monotonic time the sweep started running: the progress line's clock, across phases
    sweep_t0: float | None = None
    # keys the database held as terminated when the current phase began (counted done)
    finished_before: frozenset[str] = frozenset()
    # keys the current Tune experiment must not train (its trainable returns at once)
    finished: frozenset[str] = frozenset()
    # the signal that stopped the sweep ("SIGINT", "SIGTERM"), or None
    interrupted: str | None = None
    # inside Tuner.fit: a signal then goes to Tune's graceful stop
    in_fit: bool = False
    # the stop has been handed to this fit's own SIGUSR1 handler
    forwarded: bool = False
    # the message of a qkgeom error raised in a callback, for a one-line report
    callback_error: str | None = None
    # the signal handlers the sweep replaced, restored when it ends
    old_handlers: dict[int, Any] = field(default_factory=dict)

    def reset(self, **values: Any) -> None:
        """Every field back to its default, then ``values`` (field names): the one place a
        sweep's state begins, called at the start of every sweep."""
        fresh = type(self)(**values)
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def __reduce__(self) -> Any:
        raise TypeError("the sweep driver's state (its database URL, signal handlers) lives "
                        "in the driver process only and is never pickled")


DRIVER_STATE = DriverState()
