# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the engine and a backend process exchange: the spec a backend
starts from, the requests it serves and their replies (pickled over the
process's socket, one class each), and the error every failed call raises.

Every message on the socket is a status envelope: ``("ready", pid)`` once
the backend has started (``("error", why)`` if it cannot), then for each
request ``("ok", reply)`` or ``("error", why)``. The server dispatches on
the request's type; :attr:`Request.op` names a request in errors.

Imports neither vLLM nor torch: the backend processes run without them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from vllm.worker.vineyard.config import GiB, VineyardLLMCacheConfig
from vllm.worker.vineyard.storage.file_modes import FileModes, file_modes


class BackendError(RuntimeError):
    """The backend process failed, timed out, died or is disabled."""


# --------------------------------------------------------------------------
# The spec a backend starts from.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendSettings:
    """The settings a backend keeps the root by, from the config (the
    config table is their only home, hence no defaults here); ``modes``:
    those of everything it creates (``VINEYARD_CACHE_GROUP_ACCESS``)."""

    auth_key_file: str
    modes: FileModes
    disk_limit_bytes: int
    ttl_s: float
    sweep_interval_s: float

    @classmethod
    def from_config(cls, config: VineyardLLMCacheConfig) -> BackendSettings:
        return cls(
            auth_key_file=config.auth_key_file,
            modes=file_modes(config.group_access),
            disk_limit_bytes=int(config.disk_limit_gb * GiB),
            ttl_s=config.ttl_s,
            sweep_interval_s=config.sweep_interval_s,
        )


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """Everything a backend needs to open its namespace and map the buffers.

    A buffer holds ``max_blocks`` entries of ``entry_bytes`` (one KV block of
    every layer, then its trailer). The writer (``sweep=True``) also keeps
    the whole cache root (``cache_root``) within its budget.
    """

    settings: BackendSettings
    namespace_dir: str
    blocks_per_chunk: int
    entry_bytes: int
    max_blocks: int
    num_buffers: int
    sweep: bool = False
    cache_root: str = ""
    # "lookup": the scheduler's lookups (by stat, of every TP rank's
    # namespace in ``lookup_namespace_dirs``), in a process that can be
    # abandoned when the root hangs; no vineyard, no buffers.
    role: str = "cache"
    lookup_namespace_dirs: tuple[str, ...] = ()
    flat_paths: bool = True  # see ChunkFiles

    @property
    def buffer_bytes(self) -> int:
        return self.max_blocks * self.entry_bytes

    def to_json(self) -> str:
        """The spec as the backend's command line carries it."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BackendSpec:
        fields: dict[str, Any] = json.loads(text)
        settings = fields["settings"]
        settings["modes"] = FileModes(**settings["modes"])
        fields["settings"] = BackendSettings(**settings)
        return cls(**fields)


# --------------------------------------------------------------------------
# Replies.
# --------------------------------------------------------------------------


@dataclass
class BackendStats:
    """What a cache backend counted since its last reply (counters, and the
    sweeper's gauges), and the chunk files it removed meanwhile (corrupt,
    expired, evicted)."""

    counters: dict[str, int]
    removed_paths: list[str] = field(default_factory=list)
    # Chunk files found on disk that could not be read (nor removed), as
    # (path below the namespace, inode, mtime in ns): not promised again
    # until they change (see ``VineyardCacheLookup.avoid``).
    unreadable: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class UpdateReply:
    """Per segment: the entries vineyard holds now, and the reason of a
    write error (``None`` when the rest was only refused for want of its
    prefix)."""

    stored: list[tuple[int, str | None]]
    stats: BackendStats


@dataclass
class QueryReply:
    """How many entries of the query were read and verified (whole
    chunks), and how long reading and verifying took (seconds)."""

    verified: int
    stats: BackendStats
    read_s: float = 0.0
    verify_s: float = 0.0


@dataclass
class StatsReply:
    stats: BackendStats


@dataclass
class LookupReply:
    """How many leading chunks every rank holds, and the lookup's counts."""

    cached: int
    counts: dict[str, int]


@dataclass
class ProbeReply:
    """Blocks read, and the wall time it took."""

    blocks: int
    seconds: float


@dataclass
class ResetReply:
    """The chunk files removed, and how many could not be."""

    removed: list[str]
    left: int


@dataclass
class RemoveReply:
    """How many of the chunk files were there and are removed now."""

    removed: int
    stats: BackendStats


@dataclass
class PingReply:
    pid: int


# --------------------------------------------------------------------------
# Requests.
# --------------------------------------------------------------------------

ReplyT = TypeVar("ReplyT")


class Request(Generic[ReplyT]):
    """A request whose reply is a ``ReplyT`` (:attr:`reply_type` at run
    time); :attr:`op` names it in errors."""

    op: ClassVar[str]
    reply_type: ClassVar[type[Any]]


@dataclass(frozen=True)
class WriteSegment:
    """Consecutive blocks of one request, staged in a buffer from entry
    ``first_slot`` on, after the blocks ``prefix_ids``."""

    first_slot: int
    prefix_ids: list[int]
    ids: list[int]  # vineyard ids of its blocks
    digests: list[bytes]  # their chained digests (sealed into trailers)


@dataclass(frozen=True)
class UpdateRequest(Request[UpdateReply]):
    """Seal and write the segments staged in buffer ``buffer_id``."""

    op: ClassVar[str] = "update"
    reply_type: ClassVar[type[Any]] = UpdateReply
    buffer_id: int
    segments: list[WriteSegment]


@dataclass(frozen=True)
class QueryRequest(Request[QueryReply]):
    """Read the cached leading chunks of ``ids`` (which follow ``prefix``)
    into buffer ``buffer_id`` (and the ``num_buffers - 1`` after it, back to
    back) from entry 0 and verify them; a hit is a use of them, and with
    ``touch_prefix`` of the prefix's chunks too."""

    op: ClassVar[str] = "query"
    reply_type: ClassVar[type[Any]] = QueryReply
    buffer_id: int
    prefix: list[int]
    ids: list[int]
    digests: list[bytes]
    touch_prefix: bool = False
    num_buffers: int = 1


@dataclass(frozen=True)
class StatsRequest(Request[StatsReply]):
    """What the backend counted since its last reply."""

    op: ClassVar[str] = "stats"
    reply_type: ClassVar[type[Any]] = StatsReply


@dataclass(frozen=True)
class LookupRequest(Request[LookupReply]):
    """How many of the first ``max_chunks`` chunks of ``ids`` every rank
    holds (a lookup process's only request)."""

    op: ClassVar[str] = "lookup"
    reply_type: ClassVar[type[Any]] = LookupReply
    ids: list[int]
    max_chunks: int
    # Chunk files known unreadable: path below the namespace -> (inode,
    # mtime in ns); counted missing while they are unchanged.
    avoid: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeRequest(Request[ProbeReply]):
    """Read the first chunk files of ``ids`` (rank 0's), or with no ``ids``
    those its namespace lists first, at most ``max_chunks`` and about
    ``max_bytes``, timed: the link's price (a lookup process's request);
    cut once it is sure to be above ``cut_s_per_block`` (0: never)."""

    op: ClassVar[str] = "probe"
    reply_type: ClassVar[type[Any]] = ProbeReply
    ids: list[int]
    max_chunks: int
    max_bytes: int
    cut_s_per_block: float = 0.0


@dataclass(frozen=True)
class ResetRequest(Request[ResetReply]):
    """Remove every chunk file of ``namespaces`` under the cache root (a
    lookup process's, for the scheduler's ``reset_cache``)."""

    op: ClassVar[str] = "reset"
    reply_type: ClassVar[type[Any]] = ResetReply
    root: str
    namespaces: list[str]


@dataclass(frozen=True)
class RemoveRequest(Request[RemoveReply]):
    """Remove the chunk files that end at each of ``chunks`` (vineyard ids
    from token 0): what writes staged before a reset stored."""

    op: ClassVar[str] = "remove"
    reply_type: ClassVar[type[Any]] = RemoveReply
    chunks: list[list[int]]


@dataclass(frozen=True)
class PingRequest(Request[PingReply]):
    """Whether the backend serves (it answers its pid)."""

    op: ClassVar[str] = "ping"
    reply_type: ClassVar[type[Any]] = PingReply
