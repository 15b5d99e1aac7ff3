# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The operator's tool on a root that real engines wrote: ``ls`` names what
the engine wrote (its model and layout, from the manifest), ``verify``
finds a flipped byte and a truncated chunk, ``--remove`` takes them away,
the next engine writes them again and a later one hits the whole prefix
with outputs identical to no cache; ``purge --model`` leaves another
model's chunks and a file that is not the cache's alone.

The tool's commands, errors and exit codes in detail are tested on caches
without an engine in ``tests/worker/vineyard/cli/test_cli.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.vineyard_engine_testing import (
    BLOCK_SIZE,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    flip_a_payload_byte,
    run_engine,
    saved_tokens,
)
from tests.vineyard_testing import random_tokens
from vllm.worker.vineyard.cli import main
from vllm.worker.vineyard.storage.scan import scan_root

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

PROMPT_LEN = 1000
MAX_TOKENS = 8
LLM_KWARGS = {"enable_prefix_caching": False}


def tool(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    """Run the tool with ``--json``: its exit code and its document."""
    capsys.readouterr()
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_tool_on_an_engines_root(
    toy_model: str,
    toy_model_factory: Any,
    reference: ReferenceRunner,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "cache"
    prompt = random_tokens(random.Random(7), PROMPT_LEN)
    rounds = [{"prompts": [prompt], "max_tokens": MAX_TOKENS}]
    plain = reference(toy_model, [prompt], MAX_TOKENS, **LLM_KWARGS)
    other_model = toy_model_factory(seed=5)
    notes = root / "notes.txt"

    def engine(model: str, name: str) -> Any:
        run = run_engine(
            model, rounds, engine_env(root), tmp_path / name, llm_kwargs=LLM_KWARGS
        )
        assert run.last.settled
        return run

    first = engine(toy_model, "first")
    assert first.last.outputs == plain.last.outputs
    engine(other_model, "other-model")
    notes.write_text("an operator's notes, not the cache's")

    code, listing = tool(capsys, "ls", str(root))
    assert code == 0
    by_model = {ns["model"]: ns for ns in listing["namespaces"]}
    assert set(by_model) == {toy_model, other_model}
    mine = by_model[toy_model]
    assert mine["block_size"] == BLOCK_SIZE
    assert mine["chunks"] == saved_tokens(PROMPT_LEN, MAX_TOKENS) // BLOCK_SIZE
    assert [f["path"] for f in listing["not_cache"]] == [str(notes)]

    # Damage at rest: a flipped byte in one chunk, another cut short.
    chunks = sorted(
        (c for c in scan_root(str(root)).chunks if c.namespace == mine["namespace"]),
        key=lambda c: c.size,
    )
    flip_a_payload_byte(chunks[3].path)
    with open(chunks[5].path, "r+b") as f:
        f.truncate(chunks[5].size // 2)
    code, report = tool(capsys, "verify", str(root))
    assert code == 1
    assert {bad["path"] for bad in report["bad"]} == {chunks[3].path, chunks[5].path}
    code, report = tool(capsys, "verify", str(root), "--remove")
    assert code == 1  # found (and removed)
    code, report = tool(capsys, "verify", str(root))
    assert code == 0 and report["bad"] == []

    # The next engine recomputes from the first removed chunk and writes
    # both again; the one after it hits the whole prefix.
    again = engine(toy_model, "again")
    assert again.last.outputs == plain.last.outputs
    assert again.last.num_cached_tokens == [3 * BLOCK_SIZE]
    healed = engine(toy_model, "healed")
    assert healed.last.outputs == plain.last.outputs
    assert healed.last.num_cached_tokens == [cacheable_prefix(PROMPT_LEN)]

    # Purging a model leaves the other model and the notes alone.
    code, _ = tool(capsys, "purge", str(root), "--model", other_model)
    assert code == 0
    code, listing = tool(capsys, "ls", str(root))
    assert [ns["model"] for ns in listing["namespaces"]] == [toy_model]
    assert listing["namespaces"][0]["chunks"] == mine["chunks"]
    assert notes.read_text() == "an operator's notes, not the cache's"
