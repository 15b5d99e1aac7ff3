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

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from tests.v1.kv_connector.unit.vineyard_connector_testing import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    CHUNK_SIZE,
    Step,
    WorkerHarness,
    admit,
    fresh_tokens,
    make_config,
    make_layout,
    make_request,
    make_scheduler,
    num_blocks_for,
    only,
    run_step,
    tp_workers,
)
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.connector.scheduler import VineyardConnectorScheduler
from vllm.worker.vineyard.storage.digests import extend_digests

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sched(config: VineyardLLMCacheConfig) -> VineyardConnectorScheduler:
    return make_scheduler(config, [make_layout()])


def digests(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return extend_digests([], tokens, BLOCK_SIZE, salt)


_fills = itertools.count()


def cache_prompt(
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    tokens: list[int] | None,
    num_tokens: int,
    salt: str | None = None,
    **request: Any,
) -> None:
    """Save the first ``num_tokens`` (whole chunks) of ``tokens`` through a
    scheduler side and the worker, as an engine would, and wait for the
    background writes. ``request``: more ``Request`` arguments."""
    sched = make_scheduler(config, [worker.layout])
    req = make_request(
        f"fill-{next(_fills)}",
        tokens,
        cache_salt=salt,
        **request,
    )
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
    prompt = fresh_tokens(100)
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
    prompt = fresh_tokens(96)
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
    req = make_request("f", fresh_tokens(64))
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
    prompt = fresh_tokens(5 * CHUNK_SIZE + 7)
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
    prompt = fresh_tokens(3 * CHUNK_SIZE + 1)
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
    prompt = fresh_tokens(3 * CHUNK_SIZE)
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


def _adapter(path: Path, seed: int) -> str:
    """A LoRA adapter's files in PEFT's layout (the scheduler only reads
    them for their fingerprint; nothing runs them here)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    weights = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    (path / "adapter_model.safetensors").write_bytes(weights.numpy().tobytes())
    return str(path)


def _image(identifier: str, offset: int = 0) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=BLOCK_SIZE + 3),
    )


def _embeds(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


def _variants(
    kind: str, tmp_path: Path, n: int
) -> tuple[dict[str, Any], Callable[[], list[dict[str, Any]]]]:
    """Request arguments of a variant of one prompt, and (called after it
    was saved) of others whose KV differ."""
    if kind == "embeds":
        return {"prompt_embeds": _embeds(1, n)}, lambda: [
            {"prompt_embeds": _embeds(seed, n)} for seed in (2, 3)
        ]
    if kind == "mm":
        return {"mm_features": [_image("image-a")]}, lambda: [
            {"mm_features": [_image("image-b")]},
            {"mm_features": [_image("image-a", offset=BLOCK_SIZE)]},
        ]
    adapter = _adapter(tmp_path / "adapter", seed=1)

    def others() -> list[dict[str, Any]]:
        other = _adapter(tmp_path / "other", seed=2)
        # The same name and path, retrained and loaded again (a new id).
        _adapter(tmp_path / "adapter", seed=3)
        return [
            {"lora_request": LoRARequest("other", 2, other)},
            {"lora_request": LoRARequest("adapter", 3, adapter)},
        ]

    return {"lora_request": LoRARequest("adapter", 1, adapter)}, others


@pytest.mark.parametrize("kind", ["embeds", "mm", "lora"])
def test_requests_are_cached_under_their_own_keys(
    kind: str,
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    sched: VineyardConnectorScheduler,
    tmp_path: Path,
) -> None:
    """A request with prompt embeddings, an image or a LoRA adapter is
    saved and found under what determines its KV: the same again hits, a
    variant (other embeddings, another image or placement, another or a
    retrained adapter) and the bare token ids miss."""
    prompt = fresh_tokens(3 * CHUNK_SIZE + 1)
    tokens = None if kind == "embeds" else prompt
    first, others = _variants(kind, tmp_path, len(prompt))
    cache_prompt(config, worker, tokens, 3 * CHUNK_SIZE, **first)
    again = make_request(f"{kind}-again", tokens, **first)
    assert admit(sched, again) == 3 * CHUNK_SIZE
    assert sched._requests[again.request_id].save_from == 3 * CHUNK_SIZE
    for i, variant in enumerate(others()):
        assert admit(sched, make_request(f"{kind}-{i}", tokens, **variant)) == 0
    assert admit(sched, make_request(f"{kind}-plain", [0] * len(prompt))) == 0
    assert admit(sched, make_request(f"{kind}-bare", prompt)) == 0


def test_blocks_before_an_image_are_shared(sched: VineyardConnectorScheduler) -> None:
    """An image changes the KV from its placeholder on, not before it: the
    digests of the blocks before it equal the bare prompt's."""
    prompt = fresh_tokens(4 * BLOCK_SIZE)

    def sent(req_id: str, **kwargs: Any) -> list[bytes]:
        req = make_request(req_id, prompt, **kwargs)
        admit(sched, req)
        step = Step(new=[(req, [0, 1, 2, 3], len(prompt))])
        return only(run_step(sched, step)).new_digests

    bare = sent("before-bare")
    image = sent("before-image", mm_features=[_image("image-a", 2 * BLOCK_SIZE)])
    assert image[:2] == bare[:2]
    assert not {*image[2:]} & {*bare}


def test_cache_salt_digests(sched: VineyardConnectorScheduler) -> None:
    """Salted requests are cached under their salt: the digests sent for
    one prompt differ between two salts and from no salt, and are the same
    for the same salt."""
    prompt = fresh_tokens(64)

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
    prompt = fresh_tokens(2 * CHUNK_SIZE + 1)
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
    prompt = fresh_tokens(5 * CHUNK_SIZE + 1)
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
    from vllm.worker.vineyard.connector.metadata import VineyardHandshake

    sched = VineyardConnectorScheduler(
        config, BLOCK_SIZE, config.chunk_tokens(BLOCK_SIZE), tp_size=2
    )
    sched.set_handshakes({0: VineyardHandshake(make_layout(2, 0))})
    req = make_request("off", fresh_tokens(100))
    assert admit(sched, req) == 0
    assert run_step(sched, Step(new=[(req, list(range(7)), 100)])).requests == []
