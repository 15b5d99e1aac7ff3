# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the engine and a backend process exchange: the spec a backend
starts from, and the error every failed call raises."""

from __future__ import annotations

from dataclasses import dataclass


class BackendError(RuntimeError):
    """The backend process failed, timed out, died or is disabled."""


@dataclass(frozen=True)
class BackendSpec:
    """Everything a backend needs to open its namespace and map the buffers.

    A buffer holds ``max_blocks`` entries of ``entry_bytes`` (one KV block of
    every layer, then its trailer). The writer (``sweep=True``) also keeps
    the whole cache root (``cache_root``) within its budget.
    """

    root: str  # the namespace directory
    blocks_per_chunk: int
    entry_bytes: int
    max_blocks: int
    num_buffers: int
    auth_key_file: str = ""
    group_access: bool = False
    sweep: bool = False
    cache_root: str = ""
    disk_limit_bytes: int = 0
    ttl_s: float = 0.0
    sweep_interval_s: float = 30.0
    # "lookup": the scheduler's lookups (by stat, of every TP rank's
    # namespace in ``lookup_roots``), in a process that can be abandoned
    # when the root hangs; no vineyard, no buffers.
    role: str = "cache"
    lookup_roots: tuple[str, ...] = ()

    @property
    def buffer_bytes(self) -> int:
        return self.max_blocks * self.entry_bytes
