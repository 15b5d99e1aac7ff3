# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hits to the block: every prompt length loads all its cached complete
blocks before the token vLLM must compute.

One engine per variant (dtype, vLLM block size, chunk size, salt, key)
writes a long prompt and a short one, then asks (vLLM's own prefix cache
off, so every hit is vineyard's) the same prompts, prefixes of the long one
ending one token before, at and one token after a chunk boundary and
inside a block, a prompt shorter than a block, and a second chat turn that
starts with the first turn's prompt and answer. Each must get exactly its
expected hit and generate what an engine without the cache generates.

With the default chunk (one block) the expected hit is every complete block
before the last token; with a larger chunk (a setting) a prompt that holds a
chunk whole may use it in part, but one that ends inside a chunk cannot find
it (a chunk is named by all of its blocks).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.vineyard_engine_testing import (
    EngineRun,
    ModelFactory,
    ReferenceRunner,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MAX_TOKENS = 8
BOUNDARY = 512  # a multiple of every block and chunk size below
SALT = "tenant-a"


# name -> (engine arguments, cache settings, salted). vLLM's CPU attention
# takes blocks of multiples of 32 (16 is refused at startup).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, str], bool]] = {
    # Chunks of several blocks, checked exactly (float32).
    "fp32-block32-chunk128": (
        {"dtype": "float32", "block_size": 32},
        {"VINEYARD_CACHE_CHUNK_SIZE": "128"},
        True,
    ),
    "bf16-block32": ({"dtype": "bfloat16", "block_size": 32}, {}, False),
    "fp32-block128": ({"dtype": "float32", "block_size": 128}, {}, False),
    "bf16-block64-chunk256-key": (
        {"dtype": "bfloat16", "block_size": 64},
        {"VINEYARD_CACHE_CHUNK_SIZE": "256", "VINEYARD_CACHE_AUTH_KEY_FILE": "KEY"},
        False,
    ),
}


def expected_hit(length: int, saved: int, block: int, chunk: int) -> int:
    """Tokens a prompt of ``length`` loads when the first ``saved`` tokens
    of it (whole chunks) are cached."""
    return min((length - 1) // block * block, length // chunk * chunk, saved)


@pytest.fixture(scope="module")
def first_turn() -> dict[str, list[int]]:
    rng = random.Random(14)
    return {
        "long": random_tokens(rng, 2 * BOUNDARY + 37),
        "short": random_tokens(rng, 200),  # a system prompt's length
    }


def second_round(
    first: dict[str, list[int]], long_answer: list[int], block: int
) -> dict[str, list[int]]:
    long = first["long"]
    rng = random.Random(15)
    return {
        "long": long,
        "short": first["short"],
        "boundary-1": long[: BOUNDARY - 1],
        "boundary": long[:BOUNDARY],
        "boundary+1": long[: BOUNDARY + 1],
        "inside-block": long[: BOUNDARY + block // 2 + 3],
        "shorter-than-a-block": long[: min(100, block - 5)],
        "second-turn": long + long_answer + random_tokens(rng, 40),
    }


@pytest.fixture(scope="module", params=VARIANTS)
def variant(
    request: pytest.FixtureRequest,
    toy_model_factory: ModelFactory,
    reference: ReferenceRunner,
    first_turn: dict[str, list[int]],
    module_dir: Path,
) -> dict[str, Any]:
    name = request.param
    llm_kwargs, settings, salted = VARIANTS[name]
    llm_kwargs = {**llm_kwargs, "enable_prefix_caching": False}
    workdir = module_dir / name
    workdir.mkdir()
    settings = dict(settings)
    if settings.get("VINEYARD_CACHE_AUTH_KEY_FILE") == "KEY":
        key = workdir / "auth.key"
        key.write_text("a shared secret of the instances\n")
        settings["VINEYARD_CACHE_AUTH_KEY_FILE"] = str(key)
    model = toy_model_factory()
    block = llm_kwargs["block_size"]
    chunk = int(settings.get("VINEYARD_CACHE_CHUNK_SIZE", block))
    first = list(first_turn.values())
    ref_first = reference(model, first, max_tokens=MAX_TOKENS, **llm_kwargs)
    prompts = second_round(first_turn, ref_first.last.outputs[0], block)
    # One request at a time, here and in the cached round: in bfloat16 how
    # a batch's prefill is split (which depends on when each load
    # finishes) changes rounding, as with vLLM's own prefix cache.
    ref_second = reference(
        model, list(prompts.values()), MAX_TOKENS, True, **llm_kwargs
    )
    salt = SALT if salted else None
    rounds: list[dict[str, Any]] = [
        {"prompts": first, "max_tokens": MAX_TOKENS, "cache_salt": salt},
        {
            "prompts": list(prompts.values()),
            "max_tokens": MAX_TOKENS,
            "cache_salt": salt,
            "one_by_one": True,
        },
    ]
    if salted:  # another tenant's salt shares nothing
        rounds.append({"prompts": [first_turn["long"]], "cache_salt": "tenant-b"})
    run = run_engine(
        model,
        rounds,
        engine_env(workdir / "cache", extra=settings),
        workdir,
        llm_kwargs=llm_kwargs,
    )
    return {
        "name": name,
        "run": run,
        "block": block,
        "chunk": chunk,
        "prompts": prompts,
        "first_outputs": ref_first.last.outputs,
        "second_outputs": ref_second.last.outputs,
        "salted": salted,
    }


def test_outputs_identical_to_no_cache(variant: dict[str, Any]) -> None:
    """Identical in float32. In bfloat16 a prefill split at another token
    (a loaded prefix vs one pass) rounds differently, as with vLLM's own
    prefix cache, and a near tie can flip a greedy token: seen once in 8
    tokens of one prompt, and, on a CPU without AVX-512 (bfloat16 through
    float32), the first token of one of 8 prompts while another prompt
    that loads the same 512 tokens matched. There the first round (no
    hits) must match entirely and every first token but one; the float32
    variants check the same paths exactly, chunks of several blocks
    included."""
    run: EngineRun = variant["run"]
    assert run.rounds[0].outputs == variant["first_outputs"]
    if VARIANTS[variant["name"]][0]["dtype"] == "float32":
        assert run.rounds[1].outputs == variant["second_outputs"]
    else:
        firsts = [o[0] for o in run.rounds[1].outputs]
        wanted = [o[0] for o in variant["second_outputs"]]
        assert sum(a != b for a, b in zip(firsts, wanted, strict=True)) <= 1
    assert run.last.counter("load_errors") == 0
    assert run.last.counter("corrupt_chunks") == 0


def test_every_length_hits_to_the_block(
    variant: dict[str, Any], first_turn: dict[str, list[int]]
) -> None:
    run: EngineRun = variant["run"]
    block, chunk = variant["block"], variant["chunk"]
    assert run.rounds[0].settled  # every write done before the second round
    assert run.rounds[0].num_cached_tokens == [0, 0]
    saved = {
        name: (len(p) + MAX_TOKENS - 1) // chunk * chunk
        for name, p in first_turn.items()
    }
    prompts: dict[str, list[int]] = variant["prompts"]
    expected = {
        name: expected_hit(
            len(p), saved["short" if name == "short" else "long"], block, chunk
        )
        for name, p in prompts.items()
    }
    got = dict(zip(prompts, run.rounds[1].num_cached_tokens, strict=True))
    assert got == expected
    if chunk == block:
        # What the default promises: at most one block plus the token vLLM
        # must compute is recomputed, whatever the length (the second turn
        # loads the first turn's prompt and answer but its own new tokens).
        for name, p in prompts.items():
            if name != "second-turn":
                assert len(p) - got[name] <= block, name
        first_len = len(first_turn["long"]) + MAX_TOKENS - 1
        assert got["second-turn"] == first_len // block * block
        assert got["short"] == 199 // block * block
    assert run.delta(1, "loaded_tokens") == sum(expected.values())
    assert run.delta(1, "hit_tokens") == sum(expected.values())
    if variant["salted"]:
        assert run.rounds[2].num_cached_tokens == [0]
