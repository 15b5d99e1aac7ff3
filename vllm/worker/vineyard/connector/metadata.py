# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What crosses from the scheduler to the workers each step (what to load
and from where to save), from the workers to the scheduler each step (what
each rank saved and whether it can load), and once (the handshake)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm.worker.vineyard.storage.layout import KVCacheLayout


@dataclass
class RequestDelta:
    """A scheduled request's news for this step. Blocks are named by their
    chained digests (see :mod:`~vllm.worker.vineyard.storage.digests`), sent
    once each, so a decode step costs a few integers."""

    req_id: str
    new_digests: list[bytes]  # the worker's digests from digests_from on
    block_ids: list[int]  # appended, or the whole list if replace_blocks
    replace_blocks: bool  # first schedule, or resumed after preemption
    num_computed_tokens: int  # tokens whose KV exists after this step
    # The scheduler's decision: chunks from here on are saved. It moves
    # back when a load came up short (the chunks recomputed then are saved
    # again on every rank), and on when the lookup of a request computed
    # without waiting for it comes in; skipped and failed saves a rank
    # re-issues itself, from its own progress.
    save_from: int
    # Blocks before it vLLM has freed (a sliding window moved past them):
    # never read from or written to, whatever the worker's table says.
    held_from: int = 0
    load: tuple[int, int] | None = None  # load tokens [start, end) first
    # What computing a token costs the engine now: a load slower than
    # computing the rest stops (None: unknown yet, never stopped).
    compute_s_per_token: float | None = None
    # What the link's recent loads took per block: a read that waits many
    # times longer has stalled, and stops the load sooner (None: unknown).
    load_s_per_block: float | None = None
    # Load before the forward pass, stopped after this long (None: while
    # the request waits, reported finished by get_finished).
    sync_wait_s: float | None = None
    digests_from: int = 0  # the index of new_digests[0] (0 after a reset)


@dataclass
class ReadAheadOrder:
    """Read ahead a queued request's hit: tokens ``[start, end)``, whose
    blocks ``digests`` name from token 0 (to the end of ``end``'s chunk)."""

    req_id: str
    digests: list[bytes]
    start: int
    end: int


@dataclass
class VineyardConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestDelta] = field(default_factory=list)
    read_aheads: list[ReadAheadOrder] = field(default_factory=list)
    # reset_cache calls so far: writes staged before the last one are
    # dropped or removed, and never reported
    resets: int = 0


@dataclass
class VineyardHandshake(KVConnectorHandshakeMetadata):
    """A worker's layout, so the scheduler looks up the same namespace."""

    layout: KVCacheLayout


@dataclass
class VineyardWorkerReport(KVConnectorWorkerMetadata):
    """Each TP rank's news after a step, combined over ranks by vLLM
    (:meth:`aggregate`): the scheduler decides on the minimum."""

    # rank -> (request, first token, end) of each run of tokens its writes
    # stored since the last report, in write order
    stored: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)
    # rank -> whether its reader can load now (only when it changed)
    can_load: dict[int, bool] = field(default_factory=dict)
    # chunk files that the ranks' sweeps or readers removed (KV events)
    removed: list[str] = field(default_factory=list)
    # chunk files the ranks' readers could not read (path below the
    # namespace, inode, mtime in ns): not promised until they change
    unreadable: list[tuple[str, int, int]] = field(default_factory=list)
    # (blocks, seconds) of the ranks' finished loads: what loading costs
    load_times: list[tuple[int, float]] = field(default_factory=list)
    # rank -> {request: (first token, end)} read ahead whole, when it moved
    # on ((0, 0): dropped)
    read_ahead: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    # the reset_cache calls the ranks knew of (the fewest): what is stored
    # by writes staged before a later reset is not news
    resets: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> VineyardWorkerReport:
        assert isinstance(other, VineyardWorkerReport)
        return VineyardWorkerReport(
            stored={**self.stored, **other.stored},
            can_load={**self.can_load, **other.can_load},
            removed=self.removed + other.removed,
            unreadable=self.unreadable + other.unreadable,
            load_times=self.load_times + other.load_times,
            read_ahead={**self.read_ahead, **other.read_ahead},
            resets=min(self.resets, other.resets),
        )
