# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the cache's background work runs: off the forward pass's cores.

Imports neither vLLM nor torch (the backend processes use it)."""

from __future__ import annotations

import contextlib
import os


def move_off_the_workers_cores() -> None:
    """Run the calling thread (and what it starts) on the cores the worker
    does not use, or on every core if there are no others. vLLM's CPU
    worker binds itself, its threads and its children to its OpenMP cores,
    and the cache's background work must not take CPU from the forward
    pass while another core is free."""
    if not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        every = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, (every - os.sched_getaffinity(0)) or every)
