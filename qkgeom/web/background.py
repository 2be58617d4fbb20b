"""Results computed in background threads and kept per data version, so a web page never
waits long for a slow computation (used by :mod:`qkgeom.web.serve`)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any


class Jobs:
    """Results computed in background threads, kept per key with the data version they
    were computed on. A request asks for (key, version): the result for that version if
    there is one; otherwise a computation starts (one per key at a time) and the request
    waits up to ``wait_s`` for it, then gets the newest older result (``fresh`` False) or
    None. So a slow verdict never holds a page for long, and a page shows the last
    verdicts while new ones are computed. A key is recomputed at most once per
    ``min_interval_s`` (counted from the end of its last computation), so readers of a
    sweep that writes all the time do not keep the CPUs busy."""

    def __init__(self, wait_s: float, min_interval_s: float = 0.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.wait_s = wait_s
        self.min_interval_s = min_interval_s
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qkgeom-serve")
        self.latest: dict[Any, tuple[Any, Any, float]] = {}  # version, value, done at
        self.running: dict[Any, tuple[Any, Any]] = {}
        self.lock = threading.Lock()

    def _run(self, key: Any, version: Any, make: Callable[[], Any]) -> None:
        try:
            value = make()
        except Exception as e:  # shown on the page as one line, never a traceback
            value = Failed(f"{type(e).__name__}: {e}".splitlines()[0])
        with self.lock:
            self.latest[key] = (version, value, time.monotonic())
            self.running.pop(key, None)

    def get(self, key: Any, version: Any, make: Callable[[], Any], *,
            wait_s: float | None = None) -> tuple[Any, bool]:
        """(value or None, fresh); ``wait_s`` None: this object's default, inf: block."""
        with self.lock:
            have = self.latest.get(key)
            if have is not None and have[0] == version:
                return have[1], True
            run = self.running.get(key)
            if run is None and have is not None and \
                    time.monotonic() - have[2] < self.min_interval_s:
                return have[1], False  # computed recently enough: keep it for now
            if run is None:
                fut = self.pool.submit(self._run, key, version, make)
                self.running[key] = (version, fut)
            else:
                fut = run[1] if run[0] == version else None
        wait = self.wait_s if wait_s is None else wait_s
        if fut is not None and wait > 0:
            from concurrent.futures import TimeoutError as FutureTimeout

            try:
                fut.result(timeout=None if math.isinf(wait) else wait)
            except FutureTimeout:
                pass
        with self.lock:
            have = self.latest.get(key)
        if have is None:
            return None, False
        return have[1], have[0] == version

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Failed:
    """A computation that raised: its one-line message (shown instead of a result)."""

    def __init__(self, message: str) -> None:
        self.message = message
