# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The environment variable table: defaults, valid values and every kind of
bad value, which must raise a ValueError naming the variable, the value
given and what is allowed."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vineyard_cache_testing import make_layout, random_kv

from vllm.worker.vineyard_llm_cache import (
    ENV_VARS,
    VineyardLLMCache,
    VineyardLLMCacheConfig,
)

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class EnvCase:
    """How one variable of :data:`ENV_VARS` is tested."""

    field: str  # the VineyardLLMCacheConfig field it sets
    valid: tuple[tuple[str, Any], ...]  # (raw value, parsed value)
    # (raw value, a fragment of the allowed range the error must state)
    bad: tuple[tuple[str, str], ...]


BOOL_BAD = (("2", "1 or 0"), ("maybe", "1 or 0"), ("", "1 or 0"))

CASES: dict[str, EnvCase] = {
    "VLLM_USE_VINEYARD_CACHE": EnvCase(
        "enabled", (("1", True), ("true", True), ("0", False), (" ON ", True)), BOOL_BAD
    ),
    "VINEYARD_CACHE_CPU_MEM_LIMIT_GB": EnvCase(
        "cpu_mem_limit_gb",
        (("2.5", 2.5), ("16", 16.0)),
        (
            ("lots", "(0, inf]"),
            ("0", "(0, inf]"),
            ("-3", "(0, inf]"),
            ("inf", "(0, inf]"),
            ("nan", "(0, inf]"),
        ),
    ),
    "VINEYARD_CACHE_ENABLE_ASYNC_UPDATE": EnvCase(
        "enable_async_update", (("0", False), ("no", False), ("1", True)), BOOL_BAD
    ),
    "VINEYARD_CACHE_ASYNC_UPDATE_CPU_MEM_UTIL": EnvCase(
        "async_update_cpu_mem_util",
        (("0.25", 0.25), ("1", 1.0), ("0", 0.0)),
        (
            ("half", "[0, 1]"),
            ("-0.1", "[0, 1]"),
            ("1.5", "[0, 1]"),
            ("nan", "[0, 1]"),
        ),
    ),
    "VINEYARD_CACHE_MIN_INFLIGHT_TASKS": EnvCase(
        "min_inflight_tasks",
        (("2", 2), ("4", 4)),
        (
            ("two", "[1, inf]"),
            ("0", "[1, inf]"),
            ("-1", "[1, inf]"),
            ("1.5", "[1, inf]"),
        ),
    ),
    "VINEYARD_CACHE_MAX_INFLIGHT_TASKS": EnvCase(
        "max_inflight_tasks",
        (("8", 8), (" 1 ", 1)),
        (("many", "[1, inf]"), ("0", "[1, inf]"), ("-4", "[1, inf]")),
    ),
    "VINEYARD_CACHE_METRICS_ENABLED": EnvCase(
        "metrics_enabled", (("yes", True), ("off", False)), BOOL_BAD
    ),
    "VINEYARD_CACHE_ROOT": EnvCase(
        "root",
        (
            ("/srv/kv-cache", "/srv/kv-cache"),
            ("relative/dir", os.path.abspath("relative/dir")),
            ("~/kv", os.path.expanduser("~/kv")),
        ),
        (("", "a directory path"), ("   ", "a directory path")),
    ),
    "VINEYARD_CACHE_CHUNK_SIZE": EnvCase(
        "chunk_size",
        (("512", 512), ("16", 16)),
        (
            ("big", "[1, inf]"),
            ("0", "[1, inf]"),
            ("-256", "[1, inf]"),
            ("12.5", "[1, inf]"),
        ),
    ),
    "VINEYARD_CACHE_TTL_S": EnvCase(
        "ttl_s", (("60", 60),), (("soon", "[1, inf]"), ("0", "[1, inf]"))
    ),
    "VINEYARD_CACHE_BACKEND_TIMEOUT_S": EnvCase(
        "backend_timeout_s",
        (("2.5", 2.5),),
        (("slow", "(0, inf]"), ("0", "(0, inf]"), ("-1", "(0, inf]")),
    ),
    "VINEYARD_CACHE_DRAIN_TIMEOUT_S": EnvCase(
        "drain_timeout_s",
        (("0", 0.0), ("7.5", 7.5)),
        (("later", "[0, inf]"), ("-1", "[0, inf]"), ("inf", "[0, inf]")),
    ),
}

DEFAULTS = VineyardLLMCacheConfig()


def _bad_values() -> list[Any]:
    return [
        pytest.param(name, raw, allowed, id=f"{name}={raw!r}")
        for name, case in CASES.items()
        for raw, allowed in case.bad
    ]


def _valid_values() -> list[Any]:
    return [
        pytest.param(name, raw, value, id=f"{name}={raw!r}")
        for name, case in CASES.items()
        for raw, value in case.valid
    ]


def test_every_variable_is_tested() -> None:
    assert set(CASES) == set(ENV_VARS)
    fields = {f.name for f in dataclasses.fields(VineyardLLMCacheConfig)}
    assert {case.field for case in CASES.values()} == fields


def test_empty_environment_gives_the_defaults() -> None:
    assert VineyardLLMCacheConfig.from_env({}) == DEFAULTS


@pytest.mark.parametrize("name", sorted(ENV_VARS))
def test_default_parses_to_the_dataclass_default(name: str) -> None:
    var = ENV_VARS[name]
    expected = getattr(DEFAULTS, CASES[name].field)
    assert var.parse(name, var.default) == expected
    assert var.allowed and var.help


@pytest.mark.parametrize(("name", "raw", "value"), _valid_values())
def test_valid_value(name: str, raw: str, value: Any) -> None:
    config = VineyardLLMCacheConfig.from_env({name: raw})
    field = CASES[name].field
    assert getattr(config, field) == value
    assert type(getattr(config, field)) is type(getattr(DEFAULTS, field))
    # Nothing else changed.
    assert dataclasses.replace(config, **{field: getattr(DEFAULTS, field)}) == DEFAULTS


@pytest.mark.parametrize(("name", "raw", "allowed"), _bad_values())
def test_bad_value_names_variable_value_and_range(
    name: str, raw: str, allowed: str
) -> None:
    with pytest.raises(ValueError) as excinfo:
        VineyardLLMCacheConfig.from_env({name: raw})
    message = str(excinfo.value)
    assert name in message
    if raw.strip():
        assert f"{name}={raw!r}" in message
    else:
        assert "is empty" in message or f"{name}={raw!r}" in message
    assert "allowed" in message
    assert allowed in message


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VINEYARD_CACHE_CHUNK_SIZE", "64")
    monkeypatch.setenv("VINEYARD_CACHE_MAX_INFLIGHT_TASKS", "oops")
    with pytest.raises(ValueError, match="VINEYARD_CACHE_MAX_INFLIGHT_TASKS='oops'"):
        VineyardLLMCacheConfig.from_env()
    monkeypatch.setenv("VINEYARD_CACHE_MAX_INFLIGHT_TASKS", "6")
    config = VineyardLLMCacheConfig.from_env()
    assert (config.chunk_size, config.max_inflight_tasks) == (64, 6)


@pytest.mark.parametrize(("low", "high"), [("5", "2"), ("2", "1")])
def test_min_above_max_is_rejected(low: str, high: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        VineyardLLMCacheConfig.from_env(
            {
                "VINEYARD_CACHE_MIN_INFLIGHT_TASKS": low,
                "VINEYARD_CACHE_MAX_INFLIGHT_TASKS": high,
            }
        )
    message = str(excinfo.value)
    assert f"VINEYARD_CACHE_MIN_INFLIGHT_TASKS={low}" in message
    assert f"VINEYARD_CACHE_MAX_INFLIGHT_TASKS={high}" in message
    assert "allowed: MIN <= MAX" in message


def test_min_equal_to_max_is_allowed() -> None:
    config = VineyardLLMCacheConfig.from_env(
        {
            "VINEYARD_CACHE_MIN_INFLIGHT_TASKS": "3",
            "VINEYARD_CACHE_MAX_INFLIGHT_TASKS": "3",
        }
    )
    assert config.min_inflight_tasks == config.max_inflight_tasks == 3


@pytest.mark.parametrize(
    ("chunk_size", "block_size", "ok"),
    [
        (256, 16, True),
        (32, 32, True),
        (128, 128, True),
        (48, 32, False),
        (100, 16, False),
    ],
)
def test_check_chunk_size(chunk_size: int, block_size: int, ok: bool) -> None:
    config = dataclasses.replace(DEFAULTS, chunk_size=chunk_size)
    if ok:
        config.check_chunk_size(block_size)
        return
    with pytest.raises(ValueError) as excinfo:
        config.check_chunk_size(block_size)
    message = str(excinfo.value)
    assert f"VINEYARD_CACHE_CHUNK_SIZE={chunk_size}" in message
    assert f"allowed: a positive multiple of {block_size}" in message


def test_cache_rejects_a_chunk_size_that_splits_blocks(tmp_path: Path) -> None:
    kv = random_kv(1, 4, 1, 32, 8, torch.float32)
    config = dataclasses.replace(DEFAULTS, root=str(tmp_path), chunk_size=48)
    with pytest.raises(ValueError, match="VINEYARD_CACHE_CHUNK_SIZE=48"):
        VineyardLLMCache(config, make_layout(kv), 64, [kv[0]], 4)


@pytest.mark.parametrize(
    ("util", "limit_gb", "low", "high", "buffer_bytes", "expected"),
    [
        (0.5, 1.0, 1, 4, 64 * MiB, 4),  # 8 fit, clamped to MAX
        (0.5, 1.0, 1, 4, 200 * MiB, 2),  # floor(512 / 200)
        (0.5, 1.0, 1, 4, 512 * MiB, 1),
        (1.0, 2.0, 2, 16, 1 * GiB, 2),
        (0.25, 8.0, 1, 64, 100 * MiB, 20),  # floor(2048 / 100)
    ],
)
def test_num_update_buffers(
    util: float, limit_gb: float, low: int, high: int, buffer_bytes: int, expected: int
) -> None:
    config = dataclasses.replace(
        DEFAULTS,
        async_update_cpu_mem_util=util,
        cpu_mem_limit_gb=limit_gb,
        min_inflight_tasks=low,
        max_inflight_tasks=high,
    )
    assert config.num_update_buffers(buffer_bytes) == expected


@pytest.mark.parametrize(
    ("util", "limit_gb", "low", "buffer_bytes"),
    [
        (0.5, 1.0, 2, 512 * MiB),  # one fits, MIN is two
        (0.001, 0.001, 1, 1 * MiB),
        (0.0, 8.0, 1, 1 * MiB),  # no budget at all
    ],
)
def test_budget_too_small_for_min_buffers(
    util: float, limit_gb: float, low: int, buffer_bytes: int
) -> None:
    config = dataclasses.replace(
        DEFAULTS,
        async_update_cpu_mem_util=util,
        cpu_mem_limit_gb=limit_gb,
        min_inflight_tasks=low,
        max_inflight_tasks=max(low, 4),
    )
    with pytest.raises(ValueError) as excinfo:
        config.num_update_buffers(buffer_bytes)
    message = str(excinfo.value)
    assert f"VINEYARD_CACHE_ASYNC_UPDATE_CPU_MEM_UTIL={util}" in message
    assert f"VINEYARD_CACHE_CPU_MEM_LIMIT_GB={limit_gb}" in message
    assert f"VINEYARD_CACHE_MIN_INFLIGHT_TASKS={low}" in message
    need_gb = low * buffer_bytes / GiB
    assert f"allowed: UTIL x LIMIT >= {need_gb:.3f} GiB" in message
