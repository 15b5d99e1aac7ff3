# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the scheduler side keeps of each request (:class:`RequestState`):
its keys and digests, what it loads, from where it saves, how far every
rank saved it, and which of its blocks vLLM has freed (sliding windows)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.worker.vineyard.connector.hit_timing import HitTimeline
from vllm.worker.vineyard.connector.request_keys import RequestKeys
from vllm.worker.vineyard.storage.digests import extend_digests

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

NEVER = 1 << 62  # save_from of requests that must not be cached
#: The id of vLLM's null block (``BlockPool.null_block``, the first block):
#: block tables hold it where a sliding window freed a block.
NULL_BLOCK_ID = 0


def leading_freed_blocks(block_ids: Sequence[int], known: int = 0) -> int:
    """How many blocks at the front of a block table are vLLM's null block
    (freed out of a sliding window, or never allocated); they are always a
    prefix. ``known``: a count already known (the table only grows)."""
    n = min(known, len(block_ids))
    while n < len(block_ids) and block_ids[n] == NULL_BLOCK_ID:
        n += 1
    return n


@dataclass
class RequestState:
    """What the scheduler keeps of one request."""

    request: Request
    asked_at: float  # monotonic: its first lookup
    # What besides token ids names its blocks (None until its adapter's
    # identity is known), and that identity.
    keys: RequestKeys | None = None
    adapter: str | None = None
    digests: list[bytes] = field(default_factory=list)
    digests_sent: int = 0
    save_from: int = 0
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit
    load: tuple[int, int] | None = None  # to send: load tokens [start, end)
    load_blocks: list[int] = field(default_factory=list)
    loading: tuple[int, int] | None = None  # sent, not reported finished
    # Its load's wait before its step's forward pass (None: asynchronous).
    sync_wait_s: float | None = None
    # A load of this request came up short here: later lookups stop there
    # (vLLM asks again after a failed load; the same promise would fail).
    max_hit: int = NEVER
    blocks_replaced: bool = True  # the next delta carries the full block list
    found: int = 0  # tokens from 0 the lookup found on every rank
    rank_saved: dict[int, int] = field(default_factory=dict)  # from reports
    saved: int = 0  # tokens from 0 in vineyard on every rank
    announced: int = 0  # blocks announced by a KV event
    held_from: int = 0  # blocks before it vLLM has freed (sliding window)
    # Where its hit's time goes (None: no hit, or not timed any more).
    timeline: HitTimeline | None = None
    max_load_tokens: int | None = None  # its own cap (kv_transfer_params)
    # Whether its hit is computed, not loaded, for a slow link (decided
    # once, on its first hit).
    computed_for_speed: bool | None = None
    late_lookup: bool = False  # computed before its lookup was in

    @property
    def saves_from(self) -> int:
        """Where the workers save the running request from: nowhere while a
        load before its forward pass is out (it may come up short on any
        rank, and the pass ran on what it left: nothing is saved until vLLM
        reported the step)."""
        if self.load is not None or self.loading is not None:
            return NEVER
        return self.save_from

    def record_stored(self, rank: int, begin: int, end: int, tp_size: int) -> None:
        """A rank's write stored tokens ``[begin, end)`` (writes finish in
        order, so the rank's saved prefix grows when a run continues it)."""
        saved = self.rank_saved.get(rank, self.found)
        if begin <= saved < end:
            self.rank_saved[rank] = end
        self.saved = min(self.rank_saved.get(r, self.found) for r in range(tp_size))

    def rewind(self, token: int) -> None:
        """Everything from ``token`` on is to be saved again."""
        self.save_from = min(self.save_from, token)
        self.found = min(self.found, token)
        self.saved = min(self.saved, token)
        for rank, saved in self.rank_saved.items():
            self.rank_saved[rank] = min(saved, token)

    def found_late(self, token: int) -> None:
        """Its lookup, not waited for, found the chunks up to ``token``
        cached: its saves move on to there, unless a load of it came up
        short meanwhile."""
        self.late_lookup = False
        if self.max_hit == NEVER and token > self.save_from:
            self.save_from = token
            self.found = max(self.found, token)
            self.saved = max(self.saved, token)
            for rank, saved in self.rank_saved.items():
                self.rank_saved[rank] = max(saved, token)

    def load_failed(self, invalid_block_ids: set[int], bs: int, chunk: int) -> None:
        """vLLM found these blocks not loaded: if its load had one, it is
        never promised past it again, and saves again from its chunk."""
        if self.loading is None:
            return
        start, end = self.loading
        for b in range(start // bs, end // bs):
            if self.load_blocks[b] in invalid_block_ids:
                self.max_hit = min(self.max_hit, b * bs)
                self.rewind(b * bs // chunk * chunk)
                return

    def take_digests(self, num_tokens: int, block_size: int) -> tuple[int, list[bytes]]:
        """The digests of the first ``num_tokens`` tokens' complete blocks
        that were not sent to the workers yet (marked sent), and the index
        of the first of them."""
        num_tokens = min(num_tokens, self.request.num_tokens)
        digests = self.digests_up_to(num_tokens, block_size)
        first = self.digests_sent
        new = digests[first : num_tokens // block_size]
        self.digests_sent += len(new)
        return first, new

    def rekey(self, keys: RequestKeys) -> None:
        """Name its blocks anew (a reset): digests are computed and sent
        again, and everything is saved again."""
        self.keys = keys
        self.digests.clear()
        self.digests_sent = 0
        self.rewind(0)
        self.announced = 0

    def digests_up_to(self, num_tokens: int, block_size: int) -> list[bytes]:
        """The digests of the complete blocks among the first
        ``num_tokens`` tokens (computed once per block)."""
        assert self.keys is not None, "digests before the request's keys"
        if len(self.digests) * block_size < num_tokens // block_size * block_size:
            extend_digests(
                self.digests,
                self.request.all_token_ids[:num_tokens],
                block_size,
                self.keys.seed,
                self.keys.block_extra,
            )
        return self.digests


def freed_blocks(scheduler_output: SchedulerOutput, req_id: str, known: int) -> int:
    """How many leading blocks of the request vLLM has freed now (a sliding
    window moved past them; they may hold another request's KV from this
    step on): its saves never gather them. Without vLLM's block table,
    every block counts as freed (nothing is saved)."""
    state = scheduler_output.kv_connector_block_state
    table = state.get_block_ids(req_id) if state is not None else None
    if table is None:
        return NEVER
    return leading_freed_blocks(table[0], known)


def new_block_ids(
    scheduler_output: SchedulerOutput,
) -> dict[str, tuple[list[int], bool]]:
    """Per scheduled request, its blocks new in this step and whether they
    replace its block list (a new or resumed request)."""
    new_blocks: dict[str, tuple[list[int], bool]] = {}
    for new_req in scheduler_output.scheduled_new_reqs:
        new_blocks[new_req.req_id] = (list(new_req.block_ids[0]), True)
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        block_ids = cached.new_block_ids[i]
        new_blocks[req_id] = (
            list(block_ids[0]) if block_ids else [],
            req_id in cached.resumed_req_ids,
        )
    return new_blocks
