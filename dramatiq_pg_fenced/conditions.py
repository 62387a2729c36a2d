"""A condition an operator must hear of once, not once per try.

While it lasts (the schema is missing, the database refuses our role...),
every part of a worker runs into it again and again.  A :class:`Condition`
logs one line when it starts, at most one reminder per ``interval`` while it
lasts, and one line when it ends.  (Connection outages have their own, in
reconnect.py.)
"""

from __future__ import annotations

import logging
import threading
import time


class Condition:
    def __init__(self, logger: logging.Logger, what: str, *, interval: float = 60.0) -> None:
        self.logger = logger
        self.what = what
        self.interval = interval
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic
        self._told = 0.0

    @property
    def active(self) -> bool:
        return self._since is not None

    def hit(self, detail: str) -> None:
        """The condition holds (again): say so if it is new, or if the last line is *interval* old."""
        now = time.monotonic()
        with self._lock:
            if self._since is None:
                self._since, self._told = now, now
                line = f"{self.what}: {detail}"
            elif now - self._told >= self.interval:
                self._told = now
                line = f"{self.what} (for {now - self._since:.0f} s now): {detail}"
            else:
                return
        self.logger.error(line)

    def clear(self) -> None:
        """It no longer holds: say so once."""
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            self.logger.warning("%s no longer: resolved after %.0f s.", self.what, time.monotonic() - since)
