# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the cache's background work runs: off the forward pass's cores.

Imports neither vLLM nor torch (the backend processes use it)."""

from __future__ import annotations

import contextlib
import os


def _cores_not_bound_to_the_worker() -> set[int]:
    """The cores the calling (worker) thread is not bound to."""
    every = set(range(os.cpu_count() or 1))
    try:
        return every - os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set()


def default_readers(accelerator: bool) -> int:
    """How many readers a worker starts unless told: two where two cores
    are free for them, else one. With an accelerator the forward thread
    mostly waits for the device, so any two cores; a CPU worker's forward
    pass needs its cores, so two it is not bound to."""
    every = os.cpu_count() or 1
    free = every if accelerator else len(_cores_not_bound_to_the_worker())
    return 2 if free >= 2 else 1


def move_off_the_workers_cores(pid: int = 0) -> None:
    """Run the calling thread (and what it starts), or the new process
    ``pid`` that it started, on the cores the worker does not use, or on
    every core if there are no others. vLLM's CPU worker binds itself, its
    threads and its children to its OpenMP cores, and the cache's
    background work must not take CPU from the forward pass while another
    core is free (a backend process is moved as it is spawned: its
    interpreter's start alone takes 40-100 ms of a core)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        every = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(pid, _cores_not_bound_to_the_worker() or every)
