# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every cached block is the KV of the weights that serve it, however the
user names them: LoRA adapters by Hub id (served offline from the Hub
cache's own layout), by a ``~/`` path and by a relative path, updated
between two engines (the Hub's ``refs/main`` moved to a new snapshot, the
others retrained in place); and a base model whose middle tensor changes
in place (same size, same first and last MiB).

Each answer of the engine after the update equals a run without the cache
with the new weights (loading the old weights' KV would change it), and a
second ask hits: the KV saved under the new identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.vineyard_engine_testing import (
    EngineRun,
    cacheable_prefix,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens
from tests.vineyard_toy_model import make_toy_lora

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

LORA_KWARGS = {
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 1,
    "enable_prefix_caching": False,  # only vineyard serves a prefix
}
HUB_ID = "org/adapter-a"
HOME_PATH = "~/adapters/home-a"
RELATIVE_PATH = "adapters/relative-a"
NAMES = ("hub", "home", "relative")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(37)
    return [random_tokens(rng, 300), random_tokens(rng, 200)]


def hub_snapshot(hub: Path, revision: str, source: str) -> None:
    """``source``'s files as a Hub cache snapshot of ``hub``: links to
    blobs named by their SHA-256, ``refs/main`` naming ``revision``."""
    snapshot = hub / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (hub / "blobs").mkdir(exist_ok=True)
    for name in os.listdir(source):
        data = Path(source, name).read_bytes()
        blob = hub / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (hub / "refs").mkdir(exist_ok=True)
    (hub / "refs" / "main").write_text(revision)


def change_a_middle_tensor(model: str, name: str) -> None:
    """Overwrite tensor ``name`` of ``model.safetensors`` in place: the
    file keeps its size, header, first and last MiB."""
    path = Path(model, "model.safetensors")
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        begin, end = header[name]["data_offsets"]
        size = path.stat().st_size
        at = 8 + header_len + begin
        assert at > (1 << 20) and 8 + header_len + end < size - (1 << 20)
        f.seek(at)
        data = bytearray(f.read(end - begin))
        for i in range(0, len(data), 4):
            data[i : i + 4] = struct.pack("<f", random.Random(i).uniform(-0.1, 0.1))
        f.seek(at)
        f.write(bytes(data))


def _rounds(
    prompts: list[list[int]], adapters: list[list[Any] | None]
) -> list[dict[str, Any]]:
    return [{"prompts": prompts, "max_tokens": 8, "lora": a} for a in adapters]


@pytest.fixture(scope="module")
def adapter_runs(
    toy_model: str, prompts: list[list[int]], module_dir: Path
) -> tuple[EngineRun, EngineRun, EngineRun]:
    """Engine 1 asks with each adapter once; the adapters are updated;
    engine 2 asks with each twice. And the references without the cache."""
    home, work, hf = module_dir / "home", module_dir / "work", module_dir / "hf"
    sources = {
        (kind, version): make_toy_lora(
            str(module_dir / "sources" / f"{kind}-{version}"), seed=seed
        )
        for (kind, version), seed in {
            ("hub", 1): 1, ("hub", 2): 2, ("home", 1): 3, ("home", 2): 4,
            ("relative", 1): 5, ("relative", 2): 6,
        }.items()
    }  # fmt: skip
    hub = hf / "hub" / "models--org--adapter-a"
    hub_snapshot(hub, "1" * 40, sources["hub", 1])
    shutil.copytree(sources["home", 1], home / "adapters" / "home-a")
    shutil.copytree(sources["relative", 1], work / "adapters" / "relative-a")
    env = engine_env(
        module_dir / "cache",
        extra={"HOME": str(home), "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"},
    )
    by_name = [
        ["hub", 1, HUB_ID],
        ["home", 2, HOME_PATH],
        ["relative", 3, RELATIVE_PATH],
    ]
    # Fresh interpreters: the Hub client reads HF_HOME when imported.
    first = run_engine(
        toy_model,
        _rounds(prompts, list(by_name)),
        env,
        work,
        llm_kwargs=LORA_KWARGS,
        fresh=True,
    )
    # The updates: the Hub's main moves on, the others are retrained in
    # place (same name, path and id).
    hub_snapshot(hub, "2" * 40, sources["hub", 2])
    shutil.copytree(
        sources["home", 2], home / "adapters" / "home-a", dirs_exist_ok=True
    )
    shutil.copytree(
        sources["relative", 2], work / "adapters" / "relative-a", dirs_exist_ok=True
    )
    second = run_engine(
        toy_model,
        _rounds(prompts, [*by_name, *by_name]),
        env,
        work,
        llm_kwargs=LORA_KWARGS,
        fresh=True,
    )
    reference = run_engine(
        toy_model,
        _rounds(
            prompts,
            [
                [name, i + 1, sources[name, version]]
                for version in (1, 2)
                for i, name in enumerate(NAMES)
            ],
        ),
        engine_env(module_dir / "unused", use_cache=False),
        module_dir / "reference",
        llm_kwargs=LORA_KWARGS,
    )
    return first, second, reference


def test_updated_adapters_change_the_outputs(
    adapter_runs: tuple[EngineRun, EngineRun, EngineRun],
) -> None:
    """Else serving the old adapter's KV could not show."""
    outputs = [r.outputs for r in adapter_runs[2].rounds]
    assert all(outputs[i] != outputs[i + 3] for i in range(3))


def test_updated_adapters_never_get_the_old_kv(
    prompts: list[list[int]], adapter_runs: tuple[EngineRun, EngineRun, EngineRun]
) -> None:
    first, second, reference = adapter_runs
    old = [r.outputs for r in reference.rounds[:3]]
    new = [r.outputs for r in reference.rounds[3:]]
    assert [r.outputs for r in first.rounds] == old
    assert [r.outputs for r in second.rounds] == new + new
    full = [cacheable_prefix(len(p)) for p in prompts]
    # After the update: misses, then hits of the KV saved under the new
    # identity.
    assert [r.num_cached_tokens for r in second.rounds] == [[0, 0]] * 3 + [full] * 3
    assert second.last.counter("load_errors") == 0
    assert second.last.counter("unidentified_weights") == 0


def test_a_base_model_changed_in_place_is_another_model(
    toy_model: str, prompts: list[list[int]], module_dir: Path
) -> None:
    model = str(module_dir / "base-model")
    shutil.copytree(toy_model, model)
    env = engine_env(module_dir / "base-cache")
    no_cache = engine_env(module_dir / "unused", use_cache=False)
    run_engine(model, _rounds(prompts, [None]), env, module_dir / "base-1")
    before = run_engine(model, _rounds(prompts, [None]), no_cache, module_dir / "ref-1")
    change_a_middle_tensor(model, "model.layers.1.self_attn.k_proj.weight")
    after = run_engine(
        model, _rounds(prompts, [None, None]), env, module_dir / "base-2"
    )
    expected = run_engine(
        model, _rounds(prompts, [None]), no_cache, module_dir / "ref-2"
    )
    assert expected.last.outputs != before.last.outputs
    assert [r.outputs for r in after.rounds] == [expected.last.outputs] * 2
    full = [cacheable_prefix(len(p)) for p in prompts]
    assert [r.num_cached_tokens for r in after.rounds] == [[0, 0], full]
