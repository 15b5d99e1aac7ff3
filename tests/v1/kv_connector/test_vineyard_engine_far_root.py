# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A root whose link drops mid-run, and requests that steer the cache, on
the real engine with the default load policy (``auto``).

The root is a FUSE filesystem (``benchmarks/vineyard/slow_fs.py``) whose
reads all cross one link. One engine runs the rounds below; every answer
equals a run without the cache:

- the prompts are saved, then loaded;
- a request that opts out (``kv_transfer_params``) is neither saved nor
  loaded; one that caps its load loads no more than its cap;
- the link drops to 0.25 MB/s (loading the hits takes several times
  longer than computing them): the next loads stop early, and soon the hits
  are computed without a load (counted);
- the link recovers: after the probe interval the link is priced again by
  a timed read of a hit's chunk files (that hit is computed meanwhile), and
  the hits after it load (on a machine busy with other engines a load may
  still stop early at a hiccup of the FUSE daemon: at least one of the four
  hits of the two rounds after the probe loads its whole prefix).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.script_testing import mount_slow_fs
from tests.vineyard_engine_testing import (
    CHUNK_SIZE,
    EngineRun,
    ModelFactory,
    cacheable_prefix,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens
from vllm.worker.vineyard.connector.load_costs import PROBE_INTERVAL_S

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

LLM_KWARGS = {"enable_prefix_caching": False}  # only vineyard serves a prefix
OPT_OUT = {"vineyard_cache": False}
#: The link when it drops: loading a token (2 KiB) takes 8 ms, several
#: times what computing it takes even on a machine busy with other engines.
SLOW_MBPS = 0.25
CAP = 256
#: Rounds: (name, prompts, kv_transfer_params, link MB/s or None, pause).
ROUNDS: list[tuple[str, str, dict[str, Any] | None, float | None, float]] = [
    ("save", "P", None, None, 0.0),
    ("hit", "P", None, None, 0.0),
    ("opt-out-new", "Q", OPT_OUT, None, 0.0),
    ("opt-out-cached", "P", OPT_OUT, None, 0.0),
    ("capped", "P", {"vineyard_max_load_tokens": CAP}, None, 0.0),
    ("slow-1", "P", None, SLOW_MBPS, 0.0),
    ("slow-2", "P", None, None, 0.0),
    ("slow-3", "P", None, None, 0.0),
    ("recovered", "P", None, 0.0, PROBE_INTERVAL_S + 1.0),
    ("after-probe", "P", None, None, 0.0),
    ("after-probe-2", "P", None, None, 0.0),
]


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(43)
    return {
        "P": [random_tokens(rng, 1000), random_tokens(rng, 900)],
        "Q": [random_tokens(rng, 700)],
    }


@pytest.fixture(scope="module")
def model(toy_model_factory: ModelFactory) -> str:
    """A compute-heavy toy (wide layers, one KV head: 2 KiB of KV per
    token): loading beats computing by far at full speed, and loses by far
    at 0.25 MB/s."""
    return toy_model_factory(
        hidden_size=1024, intermediate_size=4096, num_heads=16, num_kv_heads=1
    )


@pytest.fixture(scope="module")
def runs(
    model: str, prompts: dict[str, list[list[int]]], module_dir: Path
) -> tuple[EngineRun, EngineRun]:
    fs = mount_slow_fs(module_dir / "fs", direct_io=True)
    try:
        rounds = []
        for label, name, params, mbps, pause_s in ROUNDS:
            rounds.append(
                {
                    "prompts": prompts[name],
                    "kv_transfer_params": params,
                    "fs_control": None
                    if mbps is None
                    else [str(fs.control_file), {"read_mbps": mbps}],
                    "pause_s": pause_s,
                    # One request at a time: each decision sees the loads
                    # before it.
                    "one_by_one": label != "save",
                }
            )
        env = engine_env(
            fs.mount / "root",
            # One block per chunk, whatever the FUSE root's round trip: the
            # test counts hits in blocks.
            extra={
                "VINEYARD_CACHE_LOAD_POLICY": "auto",
                "VINEYARD_CACHE_CHUNK_SIZE": str(CHUNK_SIZE),
            },
        )
        run = run_engine(
            model, rounds, env, module_dir / "engine", llm_kwargs=LLM_KWARGS
        )
    finally:
        fs.close()
    reference = run_engine(
        model,
        [{"prompts": prompts["P"] + prompts["Q"]}],
        engine_env(module_dir / "unused", use_cache=False),
        module_dir / "reference",
        llm_kwargs=LLM_KWARGS,
    )
    return run, reference


def round_index(name: str) -> int:
    return [r[0] for r in ROUNDS].index(name)


def test_every_answer_equals_no_cache(
    runs: tuple[EngineRun, EngineRun], prompts: dict[str, list[list[int]]]
) -> None:
    run, reference = runs
    expected = reference.last.outputs
    by_name = {"P": expected[:2], "Q": expected[2:]}
    for (label, name, *_), r in zip(ROUNDS, run.rounds, strict=True):
        assert r.outputs == by_name[name], label


def test_requests_that_opt_out_or_cap(
    runs: tuple[EngineRun, EngineRun], prompts: dict[str, list[list[int]]]
) -> None:
    run, _ = runs
    full = [cacheable_prefix(len(p)) for p in prompts["P"]]
    hit = round_index("hit")
    first, second = run.rounds[hit].num_cached_tokens
    assert first == full[0]  # nothing priced yet: loaded whole
    # The second loads whole too, unless the first load, on a machine busy
    # with other engines, priced the link slow: then it says so.
    slow = run.delta(hit, "tokens_not_loaded_slow") + run.delta(
        hit, "loads_stopped_slow"
    )
    assert second == full[1] or slow > 0
    for label in ("opt-out-new", "opt-out-cached"):
        i = round_index(label)
        assert set(run.rounds[i].num_cached_tokens) == {0}, label
        assert run.delta(i, "tokens_written") == 0, label
        assert run.delta(i, "loaded_tokens") == 0, label
        assert run.delta(i, "requests_opted_out") == len(run.rounds[i].outputs)
    # No request loads more than its cap (a load stopped for slowness on a
    # busy machine loads less).
    i = round_index("capped")
    assert all(n <= CAP for n in run.rounds[i].num_cached_tokens)
    assert 0 < run.delta(i, "loaded_tokens") <= len(prompts["P"]) * CAP


def test_a_slow_link_costs_no_more_than_computing(
    runs: tuple[EngineRun, EngineRun],
) -> None:
    run, _ = runs
    first, last = round_index("slow-1"), round_index("slow-3")
    slow = range(first, last + 1)
    assert sum(run.delta(i, "loads_stopped_slow") for i in slow) >= 1
    assert sum(run.delta(i, "tokens_not_loaded_slow") for i in slow) > 0
    # By the last slow round the hits are computed without a load.
    assert run.delta(last, "loaded_tokens") == 0
    assert set(run.rounds[last].num_cached_tokens) == {0}


def test_hits_load_again_once_the_link_recovers(
    runs: tuple[EngineRun, EngineRun], prompts: dict[str, list[list[int]]]
) -> None:
    run, _ = runs
    full = [cacheable_prefix(len(p)) for p in prompts["P"]]
    after = [round_index("after-probe"), round_index("after-probe-2")]
    assert sum(run.delta(i, "loaded_tokens") for i in after) > 0
    loaded = [
        n == f
        for i in after
        for n, f in zip(run.rounds[i].num_cached_tokens, full, strict=True)
    ]
    assert any(loaded), [run.rounds[i].num_cached_tokens for i in after]
