# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side of ``VineyardConnector`` without an engine.

Real ``Request`` and ``SchedulerOutput`` objects are driven step by step
(see :class:`vineyard_connector_testing.Step`) and the metadata the
scheduler side builds is checked delta by delta: digests are sent once,
block ids are appended (or replaced on resume after preemption), loads are
the ranges the lookup promised, and requests whose KV the token ids do not
determine are never cached. Lookups run against chunk files written by
real worker-side caches (real vineyard backends).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vineyard_connector_testing import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    CHUNK_SIZE,
    Allocated,
    Step,
    WorkerHarness,
    admit,
    make_config,
    make_layout,
    make_request,
    make_scheduler,
    num_blocks_for,
    only,
    random_tokens,
    run_step,
    tp_workers,
)
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from vllm.worker.vineyard_config import VineyardLLMCacheConfig
from vllm.worker.vineyard_connector_scheduler import NEVER, VineyardConnectorScheduler
from vllm.worker.vineyard_lookup import VineyardCacheLookup
from vllm.worker.vineyard_store import extend_digests

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sched(config: VineyardLLMCacheConfig) -> VineyardConnectorScheduler:
    return make_scheduler(config, [make_layout()])


def digests(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return extend_digests([], tokens, BLOCK_SIZE, salt)


def cache_prompt(
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    tokens: list[int],
    num_tokens: int,
    salt: str | None = None,
) -> None:
    """Save the first ``num_tokens`` (whole chunks) of ``tokens`` through a
    scheduler side and the worker, as an engine would, and wait for the
    background writes."""
    sched = make_scheduler(config, [worker.layout])
    req = make_request(f"fill-{len(tokens)}-{tokens[0]}", tokens, cache_salt=salt)
    admit(sched, req)
    blocks = list(range(num_blocks_for(num_tokens)))
    run_step(sched, Step(new=[(req, blocks, num_tokens)]), [worker])
    worker.worker.get_finished({req.request_id})
    worker.wait_for_writes()


# ---- per-step deltas --------------------------------------------------------


def test_digests_sent_once_and_blocks_appended(
    sched: VineyardConnectorScheduler,
) -> None:
    """A 100-token prompt prefilled in two steps, then decoded: each delta
    carries only the digests of chunks completed in that step (the prompt's
    and, later, the output's), the full block list once, then only the new
    blocks; the concatenation is exactly the request's chained digests."""
    prompt = random_tokens(100)
    req = make_request("r", prompt)
    assert admit(sched, req) == 0  # an empty root

    step1 = run_step(sched, Step(new=[(req, list(range(7)), 40)]))
    d1 = only(step1)
    assert d1.replace_blocks and d1.block_ids == list(range(7))
    assert d1.new_digests == digests(prompt)[:2]  # one whole chunk computed
    assert (d1.num_computed_tokens, d1.save_from, d1.load) == (40, 0, None)

    d2 = only(run_step(sched, Step(running=[(req, [], 60)])))
    assert not d2.replace_blocks and d2.block_ids == []
    assert d2.new_digests == digests(prompt)[2:6]  # chunks 1 and 2
    assert d2.num_computed_tokens == 100

    sent = d1.new_digests + d2.new_digests
    new_block = 7
    while req.num_computed_tokens < 4 * CHUNK_SIZE:
        # vLLM gives a block when the next token needs one.
        needs = req.num_computed_tokens % BLOCK_SIZE == 0
        blocks = [new_block] if needs else []
        new_block += needs
        d = only(run_step(sched, Step(running=[(req, blocks, 1)])))
        assert not d.replace_blocks and d.block_ids == blocks
        sent += d.new_digests
    # Chunk 3 holds prompt and output tokens: its digests name both.
    assert sent == digests(req.all_token_ids[: 4 * CHUNK_SIZE])
    assert len(sent) == 4 * BLOCKS_PER_CHUNK


def test_resume_after_preemption_replaces_blocks(
    sched: VineyardConnectorScheduler,
) -> None:
    """A preempted request comes back with new blocks: the delta replaces
    the worker's block list and sends no digest twice; ``save_from`` stays
    what the first lookup said."""
    prompt = random_tokens(96)
    req = make_request("p", prompt)
    admit(sched, req)
    d1 = only(run_step(sched, Step(new=[(req, [0, 1, 2, 3, 4, 5], 96)])))
    assert d1.new_digests == digests(prompt)
    # Preempted: vLLM frees its blocks and resets it; later it is
    # scheduled again (a lookup first, as for any waiting request).
    req.num_computed_tokens = 0
    admit(sched, req)
    new_blocks = [40, 41, 42, 43, 44, 45, 46]
    d2 = only(run_step(sched, Step(resumed=[(req, new_blocks, req.num_tokens)])))
    assert d2.replace_blocks and d2.block_ids == new_blocks
    assert d2.new_digests == []
    assert d2.save_from == d1.save_from == 0
    # The next step appends again.
    d3 = only(run_step(sched, Step(running=[(req, [47], 1)])))
    assert not d3.replace_blocks and d3.block_ids == [47]


def test_finished_request_is_forgotten(sched: VineyardConnectorScheduler) -> None:
    """After ``request_finished`` a step that still names the request
    (it cannot, in vLLM) carries nothing for it."""
    req = make_request("f", random_tokens(64))
    admit(sched, req)
    run_step(sched, Step(new=[(req, [0, 1, 2, 3], 64)]))
    sched.request_finished(req)
    meta = sched.build_connector_meta(Step(running=[(req, [], 1)]).output())
    assert meta.requests == []


# ---- lookups, loads and save_from -------------------------------------------


def test_lookup_loads_and_saves_from_cached_chunks(
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    sched: VineyardConnectorScheduler,
) -> None:
    """Three of a prompt's five chunks are on disk and vLLM's local prefix
    cache has the first: the external hit is chunks 1-2, the load range
    after ``update_state_after_alloc`` is exactly that, the digests sent
    cover it, and saves start after the cached chunks."""
    prompt = random_tokens(5 * CHUNK_SIZE + 7)
    cache_prompt(config, worker, prompt, 3 * CHUNK_SIZE)
    req = make_request("hit", prompt)
    assert admit(sched, req, num_local_tokens=CHUNK_SIZE) == 2 * CHUNK_SIZE
    rest = req.num_tokens - 3 * CHUNK_SIZE
    step = Step(new=[(req, list(range(num_blocks_for(req.num_tokens))), rest)])
    delta = only(run_step(sched, step))
    (load,) = step.loads
    assert load.load == (CHUNK_SIZE, 3 * CHUNK_SIZE)
    assert load.save_from == delta.save_from == 3 * CHUNK_SIZE
    assert load.new_digests == digests(prompt)[: 3 * BLOCKS_PER_CHUNK]
    assert delta.load is None
    assert (
        delta.new_digests
        == digests(prompt)[3 * BLOCKS_PER_CHUNK : 5 * BLOCKS_PER_CHUNK]
    )
    # The load is sent once.
    assert only(run_step(sched, Step(running=[(req, [], 1)]))).load is None


def test_no_external_tokens_no_load(
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    sched: VineyardConnectorScheduler,
) -> None:
    """When vLLM's local prefix cache already covers every cached chunk,
    there is nothing to load, but saves still start after the cached part."""
    prompt = random_tokens(3 * CHUNK_SIZE + 1)
    cache_prompt(config, worker, prompt, 2 * CHUNK_SIZE)
    req = make_request("local", prompt)
    assert admit(sched, req, num_local_tokens=2 * CHUNK_SIZE) == 0
    delta = only(run_step(sched, Step(new=[(req, list(range(7)), 33)])))
    assert delta.load is None
    assert delta.save_from == 2 * CHUNK_SIZE


def test_at_least_one_token_is_computed(
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    sched: VineyardConnectorScheduler,
) -> None:
    """A prompt of exactly three cached chunks hits all but its last block
    (vLLM must compute the last token to sample): the last chunk is loaded
    in part, its digests are all sent (the read names the whole chunk), and
    the worker fills exactly the hit's blocks."""
    prompt = random_tokens(3 * CHUNK_SIZE)
    cache_prompt(config, worker, prompt + [5], 3 * CHUNK_SIZE)
    req = make_request("exact", prompt)
    hit = 3 * CHUNK_SIZE - BLOCK_SIZE
    assert admit(sched, req) == hit
    source = [worker.block(b) for b in range(3 * BLOCKS_PER_CHUNK)]
    dst = list(range(40, 40 + 3 * BLOCKS_PER_CHUNK))
    last_before = worker.block(dst[-1])
    step = Step(new=[(req, dst, BLOCK_SIZE)])
    run_step(sched, step, [worker])
    (load,) = step.loads
    assert load.load == (0, hit)
    assert load.new_digests == digests(prompt)[: 3 * BLOCKS_PER_CHUNK]
    assert step.load_errors == set()
    for b, src in zip(dst[:-1], source, strict=False):
        assert torch.equal(worker.block(b), src)
    # The last block is the step's to compute, not the load's.
    assert torch.equal(worker.block(dst[-1]), last_before)


# ---- what is not cached -----------------------------------------------------


def _embeds_request(tokens: list[int]) -> Request:
    return make_request("embeds", None, prompt_embeds=torch.zeros(len(tokens), 8))


def _mm_request(tokens: list[int]) -> Request:
    image = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier="img-0",
        mm_position=PlaceholderRange(offset=0, length=16),
    )
    return make_request("mm", tokens, mm_features=[image])


def _lora_request(tokens: list[int]) -> Request:
    return make_request(
        "lora", tokens, lora_request=LoRARequest("adapter", 1, "/nonexistent")
    )


@pytest.mark.parametrize(
    "make", [_embeds_request, _mm_request, _lora_request], ids=["embeds", "mm", "lora"]
)
def test_uncacheable_requests_are_never_cached(
    make: object,
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    sched: VineyardConnectorScheduler,
) -> None:
    """The KV of prompt embeddings, images and LoRA adapters is not
    determined by token ids: even with the tokens' chunks on disk there is
    no hit, and the workers get nothing for the request (no digests, no
    save), only the plain request beside it does."""
    assert callable(make)
    prompt = random_tokens(3 * CHUNK_SIZE + 1)
    cache_prompt(config, worker, prompt, 3 * CHUNK_SIZE)
    req: Request = make(prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched._requests[req.request_id].save_from == NEVER
    sched.update_state_after_alloc(req, Allocated([]), 0)
    plain = make_request("plain", prompt)
    assert admit(sched, plain) == 3 * CHUNK_SIZE
    n = req.num_tokens
    meta = run_step(
        sched,
        Step(new=[(req, list(range(num_blocks_for(n))), n), (plain, [60, 61], 1)]),
    )
    assert [d.req_id for d in meta.requests] == ["plain"]


def test_cache_salt_digests(sched: VineyardConnectorScheduler) -> None:
    """Salted requests are cached under their salt: the digests sent for
    one prompt differ between two salts and from no salt, and are the same
    for the same salt."""
    prompt = random_tokens(64)

    def sent(req_id: str, salt: str | None) -> list[bytes]:
        req = make_request(req_id, prompt, cache_salt=salt)
        admit(sched, req)
        return only(run_step(sched, Step(new=[(req, [0, 1, 2, 3], 64)]))).new_digests

    a1, a2, b, none = sent("a1", "A"), sent("a2", "A"), sent("b", "B"), sent("n", None)
    assert a1 == a2 == digests(prompt, "A")
    assert len(a1) == 4
    assert not {*a1} & {*b} and not {*a1} & {*none} and not {*b} & {*none}


def test_cache_salt_lookups(
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    sched: VineyardConnectorScheduler,
) -> None:
    """What a salted request saved is found by the same salt only."""
    prompt = random_tokens(2 * CHUNK_SIZE + 1)
    cache_prompt(config, worker, prompt, 2 * CHUNK_SIZE, salt="tenant-a")
    found = {
        salt: admit(sched, make_request(f"s-{salt}", prompt, cache_salt=salt))
        for salt in ("tenant-a", "tenant-b", None)
    }
    assert found == {"tenant-a": 2 * CHUNK_SIZE, "tenant-b": 0, None: 0}


# ---- tensor parallelism -----------------------------------------------------


@pytest.fixture(scope="module")
def rank_workers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VineyardLLMCacheConfig, list[WorkerHarness]]]:
    """Two TP ranks' caches on one root (their own namespaces)."""
    config = make_config(tmp_path_factory.mktemp("tp-root"))
    with tp_workers(config) as workers:
        yield config, workers


@pytest.mark.parametrize("saved", [(4, 2), (2, 4), (0, 3), (3, 3)])
def test_tp_lookup_is_the_minimum_across_ranks(
    rank_workers: tuple[VineyardLLMCacheConfig, list[WorkerHarness]],
    saved: tuple[int, int],
) -> None:
    """Each rank saves some leading chunks of one prompt (each its own
    shard): a chunk is usable only if every rank has it, so the scheduler's
    hit (and ``save_from``) is the minimum, with and without a local hit."""
    config, workers = rank_workers
    prompt = random_tokens(5 * CHUNK_SIZE + 1)
    for w, chunks in zip(workers, saved, strict=True):
        if chunks:
            cache_prompt(config, w, prompt, chunks * CHUNK_SIZE)
    layouts = [w.layout for w in workers]
    lookup = VineyardCacheLookup(config, layouts)
    expect = min(saved) * CHUNK_SIZE
    assert lookup.lookup(digests(prompt), 0, len(prompt)) == (expect, expect)
    if min(saved) >= 2:
        assert lookup.lookup(digests(prompt), CHUNK_SIZE, len(prompt)) == (
            expect - CHUNK_SIZE,
            expect,
        )
    # The scheduler side asks the same question of both ranks.
    sched = make_scheduler(config, layouts)
    req = make_request("tp", prompt)
    assert admit(sched, req) == expect
    step = Step(new=[(req, list(range(11)), 1)])
    assert only(run_step(sched, step)).save_from == expect
    assert [d.load for d in step.loads] == ([(0, expect)] if expect else [])


def test_missing_rank_handshake_turns_the_cache_off(
    config: VineyardLLMCacheConfig,
) -> None:
    """With one of two ranks' handshakes (its cache failed to start) the
    scheduler side neither looks up nor sends anything."""
    from vllm.worker.vineyard_connector_metadata import VineyardHandshake

    sched = VineyardConnectorScheduler(
        config, BLOCK_SIZE, config.chunk_tokens(BLOCK_SIZE), tp_size=2
    )
    sched.set_handshakes({0: VineyardHandshake(make_layout(2, 0))})
    req = make_request("off", random_tokens(100))
    assert admit(sched, req) == 0
    assert run_step(sched, Step(new=[(req, list(range(7)), 100)])).requests == []
