# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side of ``VineyardConnector`` (EngineCore process).

It asks the cache how many more prompt tokens are cached (by file metadata,
reading no KV, on background threads: the scheduler never waits on the
filesystem) and tells the workers, per step, which cached blocks to load
into which blocks and which blocks each running request has now. Loads are
asynchronous: a request with a hit waits in ``WAITING_FOR_REMOTE_KVS``
while others run, until its workers report the load finished. Blocks are
named by chained digests of their token ids and whatever else determines
their KV (``cache_salt``, a LoRA adapter, multimodal items, prompt
embeddings: :mod:`.request_keys`), computed here once and sent to
the workers as deltas.

The scheduler owns every decision: what each request loads, where its saves
start (moved back for every rank when a load came up short), and whether
hits are promised at all (not while a rank's reader cannot load). Workers
execute and report after each step (:class:`VineyardWorkerReport`, combined
over ranks by vLLM); the scheduler follows the minimum over ranks.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.events import StorageEvents
from vllm.worker.vineyard.connector.hit_timing import HitTimeline
from vllm.worker.vineyard.connector.load_costs import LoadCosts
from vllm.worker.vineyard.connector.lookups import (
    STEP_WAIT_S,
    BackgroundLookups,
    NamespaceRemoval,
    VineyardCacheLookup,
)
from vllm.worker.vineyard.connector.metadata import (
    RequestDelta,
    VineyardConnectorMetadata,
    VineyardHandshake,
    VineyardWorkerReport,
)
from vllm.worker.vineyard.connector.request_keys import (
    RequestKeys,
    request_keys,
    request_options,
)
from vllm.worker.vineyard.connector.weight_identity import (
    AdapterIdentities,
    Pending,
)
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.chunks import extend_digests

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

NEVER = 1 << 62  # save_from of requests that must not be cached
#: The id of vLLM's null block (``BlockPool.null_block``, the first block):
#: block tables hold it where a sliding window freed a block.
NULL_BLOCK_ID = 0
#: Finished requests kept for the KV events of their last writes, at most.
MAX_FINISHED_TRACKED = 4096
#: Longest ``reset_cache`` waits for its removal of chunk files (then the
#: removal goes on in the background; the reset's fence holds at once).
RESET_WAIT_S = 1.0


def leading_freed_blocks(block_ids: Sequence[int], known: int = 0) -> int:
    """How many blocks at the front of a block table are vLLM's null block
    (freed out of a sliding window, or never allocated); they are always a
    prefix. ``known``: a count already known (the table only grows)."""
    n = min(known, len(block_ids))
    while n < len(block_ids) and block_ids[n] == NULL_BLOCK_ID:
        n += 1
    return n


@dataclass
class _RequestState:
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


class VineyardConnectorScheduler:
    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        block_size: int,
        chunk_size: int,
        tp_size: int,
        publish_events: bool = False,
        windowed: bool = False,
        cache_off: str | None = None,
        max_step_tokens: int = 8192,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._tp_size = tp_size
        self._publish_events = publish_events
        self._events: StorageEvents | None = None
        self._lookup: BackgroundLookups | None = None
        self._requests: dict[str, _RequestState] = {}
        # Requests with a hit in their first forward pass after the load.
        self._forwarding: list[_RequestState] = []
        self._namespaces: list[str] = []  # every rank's, once handshaken
        # Finished requests whose writes may still be reported (KV events).
        self._finished: collections.OrderedDict[str, _RequestState] = (
            collections.OrderedDict()
        )
        self._ranks_that_cannot_load: set[int] = set()
        self._resets = 0  # reset_cache calls (the workers follow)
        # A reset's new epoch keys blocks apart from all before it.
        self._epoch: str | None = None
        self._adapters: AdapterIdentities | None = None  # on the first LoRA
        self._removals: collections.deque[NamespaceRemoval] = collections.deque()
        self._identity_wait_left = STEP_WAIT_S
        self._costs = LoadCosts(block_size, max_step_tokens, lambda: self.metrics)
        self._log = LogLimiter(logger)
        self._idle_metrics = VineyardCacheMetrics(config.metrics_enabled)
        # Sliding-window attention: vLLM frees a running request's blocks
        # once they leave the window (and hands them to other requests).
        self._windowed = windowed
        self._cache_off = cache_off
        if cache_off:
            self._idle_metrics.add("unsupported_models")

    @property
    def metrics(self) -> VineyardCacheMetrics:
        return self._lookup.metrics if self._lookup else self._idle_metrics

    def set_handshakes(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Open each TP rank's namespace for lookups (rank order)."""
        if self._cache_off:
            return  # said at startup
        if len(metadata) < self._tp_size:
            logger.error(
                "vineyard cache open on %d of %d workers: cache off",
                len(metadata),
                self._tp_size,
            )
            return
        layouts = []
        for _, handshake in sorted(metadata.items()):
            assert isinstance(handshake, VineyardHandshake)
            layouts.append(handshake.layout)
        self._namespaces = [layout.namespace for layout in layouts]
        self._lookup = BackgroundLookups(
            VineyardCacheLookup(self.config, layouts, in_process=False),
            self.config.lookup_timeout_s,
        )
        if self._publish_events:
            self._events = StorageEvents(
                self.block_size,
                # As the workers' backends name removed files: resolved.
                [
                    layout.files(os.path.realpath(self.config.root))
                    for layout in layouts
                ],
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(tokens to load, True)``: loads are asynchronous; ``(None,
        False)`` while the lookup is pending."""
        state = self._state_of(request)
        state.load = None
        state.num_local_tokens = num_computed_tokens
        if state.save_from == NEVER:
            return 0, False
        if state.keys is None and not self._identify(state):
            return None, False  # its adapter is being identified
        if state.save_from == NEVER:
            return 0, False
        assert self._lookup is not None
        digests = state.digests_up_to(request.num_tokens, self.block_size)
        found = self._lookup.lookup(
            request.request_id, digests, num_computed_tokens, request.num_tokens
        )
        if found is None:
            return None, False  # ask again next step
        num_hit, save_from = found
        if state.digests_sent == 0:
            state.save_from = state.found = state.saved = save_from
            self._announce(state)  # found on the root
        num_hit = min(num_hit, max(0, state.max_hit - num_computed_tokens))
        if state.max_load_tokens is not None:
            cap = state.max_load_tokens // self.block_size * self.block_size
            num_hit = min(num_hit, cap)
        if self._ranks_that_cannot_load:
            num_hit = 0  # a reader is restarting or disabled: no promises
        if num_hit and state.computed_for_speed is None:
            state.computed_for_speed = (
                self.config.load_policy == "auto" and self._costs.promise(num_hit) == 0
            )
        if state.computed_for_speed:
            num_hit = 0
        if state.timeline is not None and not state.timeline.answered(num_hit):
            state.timeline = None
        return num_hit, num_hit > 0

    def _state_of(self, request: Request) -> _RequestState:
        """The request's state, made on first sight: what it asked of the
        cache (``kv_transfer_params``)."""
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        state = _RequestState(request, time.monotonic())
        state.timeline = HitTimeline(request.arrival_time)
        self._requests[request.request_id] = state
        options = request_options(request)
        state.max_load_tokens = options.max_load_tokens
        if options.problem is not None:
            self._log.warning(
                "options",
                "vineyard cache: a request's kv_transfer_params has %s: it is "
                "served without the cache",
                options.problem,
            )
        if self._lookup is None or not options.use_cache:
            state.save_from = NEVER
            if self._lookup is not None:
                self.metrics.add("requests_opted_out")
        return state

    def on_new_request(self, request: Request) -> None:
        """A request arrived: its lookup starts now, in the background, so
        it is answered by the time the request is scheduled (and while it
        waits behind others)."""
        state = self._state_of(request)
        if state.save_from == NEVER or self._lookup is None:
            return
        if state.keys is None:
            wait_left, self._identity_wait_left = self._identity_wait_left, 0.0
            known = self._identify(state)
            self._identity_wait_left = wait_left
            if not known or state.save_from == NEVER:
                return
        digests = state.digests_up_to(request.num_tokens, self.block_size)
        self._lookup.start(request.request_id, digests, request.num_tokens)

    def _identify(self, state: _RequestState) -> bool:
        """Name the request's blocks: whether its keys are known now (or it
        is served without the cache: its adapter cannot be identified, or
        not within the lookup timeout)."""
        lora = state.request.lora_request
        if lora is not None:
            if self._adapters is None:
                self._adapters = AdapterIdentities()
            started = time.monotonic()
            answer = self._adapters.identity(
                lora, state.request.request_id, self._identity_wait_left
            )
            self._identity_wait_left -= time.monotonic() - started
            if isinstance(answer, Pending):
                if started - state.asked_at < self.config.lookup_timeout_s:
                    return False
                answer = None
            if answer is None:
                state.save_from = NEVER
                self.metrics.add("unidentified_weights")
                return True
            state.adapter = answer
        state.keys = request_keys(
            state.request, self.block_size, state.adapter, self._epoch
        )
        return True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external == 0:
            return
        start, end = state.num_local_tokens, state.num_local_tokens + num_external
        state.load_blocks = list(blocks.get_block_ids()[0])
        if self._windowed:
            # Blocks out of the window are vLLM's null block: not loaded.
            state.held_from = leading_freed_blocks(state.load_blocks)
        state.load = (min(max(start, state.held_from * self.block_size), end), end)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn from the workers: which loads finished and which came up
        short (a request whose load failed at block ``b`` on any rank is
        never promised more than ``b`` again, and saves from there again on
        every rank), how far requests are saved, and which ranks can load."""
        self._forward_passes_ended()
        self._costs.step_finished()
        bs = self.block_size
        if output.invalid_block_ids:
            for state in self._requests.values():
                if state.loading is None:
                    continue
                start, end = state.loading
                for b in range(start // bs, end // bs):
                    if state.load_blocks[b] in output.invalid_block_ids:
                        state.max_hit = min(state.max_hit, b * bs)
                        state.rewind(b * bs // self.chunk_size * self.chunk_size)
                        break
        for req_id in output.finished_recving or ():
            finished = self._requests.get(req_id)
            if finished is not None:
                finished.loading = None
                if finished.timeline is not None:
                    finished.timeline.finished_loading()
        report = output.kv_connector_worker_meta
        if isinstance(report, VineyardWorkerReport):
            self._apply_report(report)

    def _apply_report(self, report: VineyardWorkerReport) -> None:
        # Writes staged before a reset stored blocks under the old epoch.
        stored = report.stored if report.resets == self._resets else {}
        for rank, runs in stored.items():
            for req_id, begin, end in runs:
                state = self._requests.get(req_id) or self._finished.get(req_id)
                if state is not None:
                    state.record_stored(rank, begin, end, self._tp_size)
                    self._announce(state)
        if report.removed and self._events is not None:
            self._events.removed(report.removed)
        if report.unreadable and self._lookup is not None:
            self._lookup.avoid(report.unreadable)
        for blocks, seconds in report.load_times:
            self._costs.observe_load(blocks, seconds)
        for rank, can_load in report.can_load.items():
            if can_load:
                self._ranks_that_cannot_load.discard(rank)
            else:
                self._ranks_that_cannot_load.add(rank)
                logger.warning(
                    "vineyard cache reader of TP rank %d cannot load: no hits "
                    "are promised until it is back",
                    rank,
                )

    def _announce(self, state: _RequestState) -> None:
        """A KV event for the request's blocks newly known to be saved."""
        end = state.saved // self.block_size
        if self._events is None or end <= state.announced:
            return
        digests = state.digests_up_to(end * self.block_size, self.block_size)
        self._events.stored(state.request, digests, state.announced, end)
        state.announced = end

    def take_events(self) -> list[KVCacheEvent]:
        return self._events.take() if self._events is not None else []

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> VineyardConnectorMetadata:
        self._forward_passes_ended()
        meta = VineyardConnectorMetadata(resets=self._resets)
        if self._lookup is None:
            return meta  # the cache is off: nothing to load or save
        self._identity_wait_left = STEP_WAIT_S
        self._costs.step_scheduled(scheduler_output.total_num_scheduled_tokens)
        self._lookup.begin_step()
        self._log_removals()
        meta.requests.extend(self._scheduled_deltas(scheduler_output))
        meta.requests.extend(self._load_deltas())
        return meta

    def _scheduled_deltas(
        self, scheduler_output: SchedulerOutput
    ) -> list[RequestDelta]:
        """What the workers need of each scheduled request: its new blocks
        and the digests of its chunks completed in this step."""
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
        deltas = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            if state.timeline is not None and state.timeline.forward_scheduled():
                self._forwarding.append(state)
            if state.save_from == NEVER:
                continue  # not cacheable: the worker needs nothing
            num_computed = state.request.num_computed_tokens + num_scheduled
            blocks, replace = new_blocks.get(req_id, ([], False))
            replace = replace or state.blocks_replaced
            if self._windowed:
                state.held_from = self._held_from(
                    scheduler_output, req_id, 0 if replace else state.held_from
                )
            needed = num_computed // self.chunk_size * self.chunk_size
            digests_from, new_digests = state.take_digests(needed, self.block_size)
            deltas.append(
                RequestDelta(
                    req_id=req_id,
                    new_digests=new_digests,
                    digests_from=digests_from,
                    block_ids=blocks,
                    replace_blocks=replace,
                    num_computed_tokens=num_computed,
                    save_from=state.save_from,
                    held_from=state.held_from,
                )
            )
            state.blocks_replaced = False
        return deltas

    def _load_deltas(self) -> list[RequestDelta]:
        """Requests allocated this step and waiting for their KV: the
        workers load it (every chunk a load reads, a chunk it ends inside
        included)."""
        chunk, deltas = self.chunk_size, []
        for req_id, state in self._requests.items():
            if state.load is None:
                continue
            start, end = state.load
            digests_from, new_digests = state.take_digests(
                -(-end // chunk) * chunk, self.block_size
            )
            deltas.append(
                RequestDelta(
                    req_id=req_id,
                    new_digests=new_digests,
                    digests_from=digests_from,
                    block_ids=state.load_blocks,
                    replace_blocks=True,
                    num_computed_tokens=start,
                    save_from=state.save_from,
                    held_from=state.held_from,
                    load=state.load,
                    compute_s_per_token=(
                        self._costs.compute_s_per_token
                        if self.config.load_policy == "auto"
                        else None
                    ),
                )
            )
            state.loading, state.load = state.load, None
            if state.timeline is not None:
                state.timeline.sent()
        return deltas

    def _forward_passes_ended(self) -> None:
        """The step that ran the forward passes scheduled after loads ended
        (vLLM calls one of the hooks that call this after each step): time
        their hits."""
        for state in self._forwarding:
            assert state.timeline is not None
            state.timeline.observe(self.metrics)
            state.timeline = None
        self._forwarding.clear()

    @staticmethod
    def _held_from(scheduler_output: SchedulerOutput, req_id: str, known: int) -> int:
        """How many leading blocks of the request vLLM has freed now (a
        sliding window moved past them; they may hold another request's KV
        from this step on): its saves never gather them. Without vLLM's
        block table, every block counts as freed (nothing is saved)."""
        state = scheduler_output.kv_connector_block_state
        table = state.get_block_ids(req_id) if state is not None else None
        if table is None:
            return NEVER
        return leading_freed_blocks(table[0], known)

    def reset_cache(self) -> bool:
        """Reset the cache: nothing computed before now is loaded by this
        instance again, and the chunks of its namespaces are removed from
        the root.

        The fence is immediate: a new epoch names every block from now on,
        so chunks written before (with old weights, or by writes still
        queued or in flight, which the workers drop or remove once they
        learn of the reset) are never looked up again; running requests
        save again from their first chunk. The removal (of the namespaces
        its TP ranks use, shared with other instances that serve the same
        model with the same settings) runs on a lookup thread: the engine
        waits for it at most :data:`RESET_WAIT_S`, then it goes on in the
        background and its result is logged. Always succeeds: the fence
        holds whatever the removal does."""
        if self._lookup is None:
            return True  # the cache is off: nothing of ours is there
        self._epoch = os.urandom(8).hex()
        self._resets += 1
        self._finished.clear()
        if self._events is not None:
            self._events.removed_all()
        for req_id, state in self._requests.items():
            self._lookup.forget(req_id)  # a lookup of the old names
            if state.keys is not None and state.save_from != NEVER:
                state.rekey(
                    request_keys(
                        state.request, self.block_size, state.adapter, self._epoch
                    )
                )
        removal = self._lookup.remove_namespaces(
            self.config.root, sorted(set(self._namespaces))
        )
        self._removals.append(removal)
        removal.done.wait(RESET_WAIT_S)
        self._log_removals()
        return True

    def _log_removals(self) -> None:
        """Log the removals of resets that finished (and count failures)."""
        while self._removals and self._removals[0].done.is_set():
            removal = self._removals.popleft()
            where = ", ".join(removal.namespaces)
            if removal.error is not None:
                self.metrics.add("reset_failures")
                logger.warning(
                    "vineyard cache reset of %s did not finish (%s): chunks may "
                    "be left on the root (never loaded by this instance)",
                    where,
                    removal.error,
                )
            else:
                logger.info(
                    "vineyard cache reset: %d chunk file(s) removed from %s%s",
                    len(removal.removed),
                    where,
                    f"; {removal.left} could not be removed" if removal.left else "",
                )

    def request_finished(self, request: Request) -> None:
        self._forward_passes_ended()
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.save_from != NEVER and self._events is not None:
            # Its last writes are reported after it finished: announce them.
            self._finished[request.request_id] = state
            while len(self._finished) > MAX_FINISHED_TRACKED:
                self._finished.popitem(last=False)
        if self._lookup is not None:
            self._lookup.forget(request.request_id)
        if self._adapters is not None and request.lora_request is not None:
            self._adapters.forget(request.lora_request, request.request_id)

    def shutdown(self) -> None:
        if self._lookup is not None:
            self._lookup.close()
        if self._adapters is not None:
            self._adapters.close()
