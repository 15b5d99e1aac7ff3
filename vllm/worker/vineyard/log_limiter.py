# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Rate-limited warnings, for what every chunk or request could trigger."""

from __future__ import annotations

import time
from typing import Any


class LogLimiter:
    """Warnings that every chunk or request could trigger (a failing disk,
    a damaged root): at most one per ``interval_s`` for each kind, with the
    number of the ones left out since."""

    def __init__(self, logger: Any, interval_s: float = 60.0):
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self._interval_s) < self._interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return
        self._last[kind] = now
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg += f" ({left_out} more like it in the last minute)"
        self._logger.warning(msg, *args)
