# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the engine-level vineyard cache tests.

Every engine runs in a fresh interpreter (see ``vineyard_engine_testing``) on
a toy Llama with seeded random weights, so loading the wrong KV changes what
it generates. Engines without the cache (the reference outputs) are run once
per session and shared.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
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
from tests.vineyard_toy_model import ToyLlamaConfig, make_toy_llama


@pytest.fixture(scope="session")
def toy_model_factory(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """``factory(**ToyLlamaConfig fields)``: a checkpoint directory, made
    once per session for each config and shared by the session's
    pytest-xdist workers (one copy on disk; engines only read it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above each worker's
    models = shared / "toy_models"
    models.mkdir(exist_ok=True)

    def factory(**fields: Any) -> str:
        config = ToyLlamaConfig(**fields)
        key = hashlib.sha256(repr(config).encode()).hexdigest()[:16]
        path = models / key
        if not path.is_dir():
            # Made aside and renamed into place: a worker that loses the
            # race drops its own copy and uses the winner's.
            made = make_toy_llama(tempfile.mkdtemp(dir=models), config)
            try:
                os.rename(made, path)
            except OSError:
                shutil.rmtree(made, ignore_errors=True)
        return str(path)

    return factory


@pytest.fixture(scope="session")
def toy_model(toy_model_factory: ModelFactory) -> str:
    """The default toy Llama (4 layers, 2 KV heads, float32, seed 0)."""
    return toy_model_factory()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ReferenceRunner:
    """``reference(model, prompts, max_tokens=8, one_by_one=False,
    **llm_kwargs)``: one
    engine without the cache (``VLLM_USE_VINEYARD_CACHE`` unset) generating
    ``prompts`` in one call; memoized for the session."""
    runs: dict[str, EngineRun] = {}

    def run(
        model: str,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 8,
        one_by_one: bool = False,
        **llm_kwargs: Any,
    ) -> EngineRun:
        key = json.dumps(
            [model, prompts, max_tokens, one_by_one, llm_kwargs], sort_keys=True
        )
        if key not in runs:
            workdir = tmp_path_factory.mktemp("reference")
            runs[key] = run_engine(
                model,
                [
                    {
                        "prompts": [list(p) for p in prompts],
                        "max_tokens": max_tokens,
                        "one_by_one": one_by_one,
                    }
                ],
                engine_env(workdir / "unused-cache-root", use_cache=False),
                workdir,
                llm_kwargs=llm_kwargs,
            )
        return runs[key]

    return run


@pytest.fixture(scope="module")
def module_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A directory for a module's engines and cache roots; removed after
    the module where none of its tests failed (the suite's disk stays
    small), kept for a look where one did."""
    failed_before = request.session.testsfailed
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)
