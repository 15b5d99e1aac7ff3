# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a lookup thread works on (:class:`~.lookups.BackgroundLookups`):
a request's lookup, or a reset's removal of namespaces."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class LookupJob:
    """One request's lookup: the filesystem's answer does not depend on
    vLLM's local hit, so a request whose local hit changes keeps its job."""

    digests: list[bytes]
    num_tokens: int
    deadline: float  # monotonic: the request's, from its first ask
    started_at: float | None = None  # when a thread began it (not queued)
    cancelled: bool = False  # replaced or answered: a thread skips it
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[int, int] = (0, 0)  # (hit end from token 0, save_from)


@dataclass
class NamespaceRemoval:
    """A reset's removal of every chunk file of ``namespaces`` (queued
    with the lookups, run in a lookup thread's process)."""

    root: str
    namespaces: list[str]
    started_at: float | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    removed: list[str] = field(default_factory=list)  # paths removed
    left: int = 0  # files that could not be removed
    error: str | None = None  # why it did not finish


Job = LookupJob | NamespaceRemoval
