# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The settings table: defaults, valid values and every kind of bad value,
which must raise a ValueError naming the variable (or the
``kv_connector_extra_config`` key), the value given and what is allowed;
``kv_connector_extra_config`` overriding the environment; and the auth key
file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.vineyard_cache_testing import make_layout, random_kv
from vllm.worker.vineyard.config import (
    ENV_VARS,
    VineyardLLMCacheConfig,
    env_name,
    setting_fields,
)
from vllm.worker.vineyard.storage.digests import load_auth_key
from vllm.worker.vineyard_llm_cache import VineyardLLMCache

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
        (("512", 512), ("16", 16), ("0", 0)),
        (
            ("big", "0 (one block) or a positive multiple"),
            ("-256", "0 (one block) or a positive multiple"),
            ("12.5", "0 (one block) or a positive multiple"),
        ),
    ),
    "VINEYARD_CACHE_DISK_LIMIT_GB": EnvCase(
        "disk_limit_gb",
        (("0.5", 0.5), ("2000", 2000.0)),
        (
            ("huge", "(0, inf]"),
            ("0", "(0, inf]"),
            ("-10", "(0, inf]"),
            ("inf", "(0, inf]"),
        ),
    ),
    "VINEYARD_CACHE_TTL_S": EnvCase(
        "ttl_s",
        (("60", 60.0), ("0", 0.0), ("0.5", 0.5)),  # 0: no TTL
        (
            ("soon", "[0, 1000000000.0]"),
            ("-1", "[0, 1000000000.0]"),
            ("nan", "[0, 1000000000.0]"),
        ),
    ),
    "VINEYARD_CACHE_SWEEP_INTERVAL_S": EnvCase(
        "sweep_interval_s",
        (("1", 1.0), ("0.25", 0.25), ("86400", 86400.0)),
        (
            ("often", "[0.1, 86400]"),
            ("0", "[0.1, 86400]"),
            ("1e-300", "[0.1, 86400]"),
            ("86401", "[0.1, 86400]"),
        ),
    ),
    "VINEYARD_CACHE_AUTH_KEY_FILE": EnvCase(
        "auth_key_file",
        (
            ("", ""),  # no key
            ("/etc/kv/secret", "/etc/kv/secret"),
            ("rel/secret", os.path.abspath("rel/secret")),
        ),
        (),  # any path parses; an unusable file fails in load_auth_key
    ),
    "VINEYARD_CACHE_GROUP_ACCESS": EnvCase(
        "group_access", (("1", True), ("off", False)), BOOL_BAD
    ),
    "VINEYARD_CACHE_BACKEND_TIMEOUT_S": EnvCase(
        "backend_timeout_s",
        (("2.5", 2.5), ("0.1", 0.1)),
        (
            ("slow", "[0.1, 3600]"),
            ("0", "[0.1, 3600]"),
            ("1e-300", "[0.1, 3600]"),
            ("3601", "[0.1, 3600]"),
        ),
    ),
    "VINEYARD_CACHE_READERS": EnvCase(
        "readers",
        (("0", 0), ("1", 1), ("8", 8)),
        (("two", "[0, 8]"), ("-1", "[0, 8]"), ("9", "[0, 8]"), ("1.5", "[0, 8]")),
    ),
    "VINEYARD_CACHE_READ_AHEAD_BUFFERS": EnvCase(
        "read_ahead_buffers",
        (("0", 0), ("4", 4), ("64", 64)),
        (("some", "[0, 64]"), ("-1", "[0, 64]"), ("65", "[0, 64]"), ("2.5", "[0, 64]")),
    ),
    "VINEYARD_CACHE_LOOKUP_TIMEOUT_S": EnvCase(
        "lookup_timeout_s",
        (("0.5", 0.5), ("600", 600.0)),
        (
            ("soon", "(0, 600]"),
            ("0", "(0, 600]"),
            ("601", "(0, 600]"),
            ("nan", "(0, 600]"),
        ),
    ),
    "VINEYARD_CACHE_LOAD_POLICY": EnvCase(
        "load_policy",
        (("auto", "auto"), ("ALWAYS", "always")),
        (("never", "auto or always"), ("", "auto or always")),
    ),
    "VINEYARD_CACHE_DRAIN_TIMEOUT_S": EnvCase(
        "drain_timeout_s",
        (("0", 0.0), ("7.5", 7.5)),
        (("later", "[0, 600]"), ("-1", "[0, 600]"), ("inf", "[0, 600]")),
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
    fields = {f.name for f in setting_fields()}
    assert {case.field for case in CASES.values()} == fields


def test_empty_environment_gives_the_defaults() -> None:
    assert VineyardLLMCacheConfig.from_env({}) == DEFAULTS


FIELDS = {f.name: f for f in setting_fields()}


@pytest.mark.parametrize("name", sorted(ENV_VARS))
def test_default_parses_to_the_dataclass_default(name: str) -> None:
    var = ENV_VARS[name]
    field = CASES[name].field
    assert var.key == field and env_name(field) == name
    parse = FIELDS[field].metadata["parse"]
    assert parse(name, var.default) == getattr(DEFAULTS, field)
    assert var.allowed == FIELDS[field].metadata["allowed"]
    assert var.allowed and var.help


def test_documented_defaults() -> None:
    """The defaults the docs promise for the settings of the v2 format."""
    assert DEFAULTS.disk_limit_gb == 100.0
    assert DEFAULTS.ttl_s == 0.0  # no expiry
    assert DEFAULTS.sweep_interval_s == 30.0
    assert DEFAULTS.auth_key_file == ""  # checksums, no MAC
    assert DEFAULTS.group_access is False  # owner only
    assert DEFAULTS.enabled is False


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
    ("chunk_size", "block_size", "tokens"),
    [
        (0, 16, 16),  # the default: one block
        (0, 128, 128),
        (256, 16, 256),
        (32, 32, 32),
        (128, 128, 128),
        (48, 32, None),
        (100, 16, None),
    ],
)
def test_chunk_tokens(chunk_size: int, block_size: int, tokens: int | None) -> None:
    config = dataclasses.replace(DEFAULTS, chunk_size=chunk_size)
    if tokens is not None:
        assert config.chunk_tokens(block_size) == tokens
        return
    with pytest.raises(ValueError) as excinfo:
        config.chunk_tokens(block_size)
    message = str(excinfo.value)
    assert f"VINEYARD_CACHE_CHUNK_SIZE={chunk_size}" in message
    assert f"allowed: 0 (one block) or a positive multiple of {block_size}" in message


def test_errors_found_after_parsing_name_the_key_the_user_wrote() -> None:
    """A chunk size from ``kv_connector_extra_config`` that splits blocks
    is reported under that key, not the environment variable's name."""
    config = VineyardLLMCacheConfig.from_env({}, {"chunk_size": 7})
    with pytest.raises(ValueError) as excinfo:
        config.chunk_tokens(16)
    message = str(excinfo.value)
    assert "kv_connector_extra_config['chunk_size']=7" in message
    assert "VINEYARD_CACHE_CHUNK_SIZE" not in message
    # From the environment, the variable is named.
    config = VineyardLLMCacheConfig.from_env({"VINEYARD_CACHE_CHUNK_SIZE": "7"})
    with pytest.raises(ValueError, match="VINEYARD_CACHE_CHUNK_SIZE=7"):
        config.chunk_tokens(16)
    # Settings checked together name their keys too.
    with pytest.raises(ValueError) as excinfo:
        VineyardLLMCacheConfig.from_env(
            {"VINEYARD_CACHE_MAX_INFLIGHT_TASKS": "1"}, {"min_inflight_tasks": 2}
        )
    message = str(excinfo.value)
    assert "kv_connector_extra_config['min_inflight_tasks']=2" in message
    assert "VINEYARD_CACHE_MAX_INFLIGHT_TASKS=1" in message


def test_cache_rejects_a_chunk_size_that_splits_blocks(tmp_path: Path) -> None:
    kv = random_kv(1, 4, 1, 32, 8, torch.float32)
    config = dataclasses.replace(DEFAULTS, root=str(tmp_path), chunk_size=48)
    with pytest.raises(ValueError, match="VINEYARD_CACHE_CHUNK_SIZE=48"):
        VineyardLLMCache(config, make_layout(kv, chunk_size=32), 64, [kv[0]], 4)
    # Nothing was started or written.
    assert not any(tmp_path.iterdir())


def budget(util: float, limit_gb: float, low: int, high: int) -> VineyardLLMCacheConfig:
    """The defaults with the staging budget and the buffer bounds given."""
    return dataclasses.replace(
        DEFAULTS,
        async_update_cpu_mem_util=util,
        cpu_mem_limit_gb=limit_gb,
        min_inflight_tasks=low,
        max_inflight_tasks=high,
    )


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
    config = budget(util, limit_gb, low, high)
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
    config = budget(util, limit_gb, low, max(low, 4))
    with pytest.raises(ValueError) as excinfo:
        config.num_update_buffers(buffer_bytes)
    message = str(excinfo.value)
    assert f"VINEYARD_CACHE_ASYNC_UPDATE_CPU_MEM_UTIL={util}" in message
    assert f"VINEYARD_CACHE_CPU_MEM_LIMIT_GB={limit_gb}" in message
    assert f"VINEYARD_CACHE_MIN_INFLIGHT_TASKS={low}" in message
    need_gb = low * buffer_bytes / GiB
    assert f"allowed: UTIL x LIMIT >= {need_gb:.3f} GiB" in message


# --------------------------------------------------------------------------
# kv_connector_extra_config
# --------------------------------------------------------------------------


def _extra_valid() -> list[Any]:
    return [
        pytest.param(case.field, raw, value, id=f"{case.field}={raw!r}")
        for case in CASES.values()
        for raw, value in case.valid
    ]


def _extra_bad() -> list[Any]:
    return [
        pytest.param(case.field, raw, allowed, id=f"{case.field}={raw!r}")
        for case in CASES.values()
        for raw, allowed in case.bad
    ]


@pytest.mark.parametrize(("key", "raw", "value"), _extra_valid())
def test_extra_config_key_overrides_the_environment(
    key: str, raw: str, value: Any
) -> None:
    """Every field's key (lower case, no prefix) sets it, and wins over a
    valid and even a bad environment variable of the same setting."""
    name = env_name(key)
    env_raw = ENV_VARS[name].default
    for env in ({}, {name: env_raw}, {name: "not-a-valid-value"}):
        if key in ("root", "auth_key_file") and env.get(name) is not None:
            env = {name: "/somewhere/else"}  # every path parses
        config = VineyardLLMCacheConfig.from_env(env, {key: raw})
        assert getattr(config, key) == value
        assert dataclasses.replace(config, **{key: getattr(DEFAULTS, key)}) == (
            DEFAULTS
        )


@pytest.mark.parametrize(("key", "raw", "allowed"), _extra_bad())
def test_extra_config_bad_value_names_the_key(key: str, raw: str, allowed: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        # A valid environment does not rescue a bad extra config value.
        VineyardLLMCacheConfig.from_env(
            {env_name(key): ENV_VARS[env_name(key)].default}, {key: raw}
        )
    message = str(excinfo.value)
    assert f"kv_connector_extra_config[{key!r}]" in message
    assert "allowed" in message and allowed in message


@pytest.mark.parametrize(
    ("extra", "value"),
    [
        ({"chunk_size": 64}, 64),  # JSON numbers, not only strings
        ({"metrics_enabled": True}, True),
        ({"ttl_s": 1.5}, 1.5),
    ],
)
def test_extra_config_takes_json_values(extra: dict[str, Any], value: Any) -> None:
    config = VineyardLLMCacheConfig.from_env({}, extra)
    ((key, _),) = extra.items()
    assert getattr(config, key) == value


@pytest.mark.parametrize(
    "key", ["chunksize", "VINEYARD_CACHE_CHUNK_SIZE", "CHUNK_SIZE", "enable"]
)
def test_extra_config_unknown_key_fails(key: str) -> None:
    """A misspelt key (or an environment variable's name) must not pass
    silently."""
    with pytest.raises(ValueError) as excinfo:
        VineyardLLMCacheConfig.from_env({}, {key: "64", "chunk_size": "64"})
    message = str(excinfo.value)
    assert f"unknown key(s) [{key!r}]" in message
    assert "allowed" in message and "'chunk_size'" in message


def test_extra_config_min_above_max_fails() -> None:
    with pytest.raises(ValueError, match="allowed: MIN <= MAX"):
        VineyardLLMCacheConfig.from_env(
            {"VINEYARD_CACHE_MAX_INFLIGHT_TASKS": "8"},
            {"min_inflight_tasks": 3, "max_inflight_tasks": 2},
        )
    # MIN from the environment, MAX from the extra config: checked together.
    with pytest.raises(ValueError, match="allowed: MIN <= MAX"):
        VineyardLLMCacheConfig.from_env(
            {"VINEYARD_CACHE_MIN_INFLIGHT_TASKS": "5"}, {"max_inflight_tasks": 4}
        )


# --------------------------------------------------------------------------
# The auth key file
# --------------------------------------------------------------------------


def test_no_key_file_means_no_key() -> None:
    assert load_auth_key("") is None


@pytest.mark.parametrize(
    "secret",
    [b"0123456789abcdef", b"  a much longer shared secret of the fleet  \n"],
)
def test_key_is_derived_from_the_secret(tmp_path: Path, secret: bytes) -> None:
    path = tmp_path / "key"
    path.write_bytes(secret)
    key = load_auth_key(str(path))
    assert key is not None and len(key) == 32
    assert key != secret.strip()  # derived, not the secret itself
    # Surrounding whitespace (a trailing newline) does not change the key.
    path.write_bytes(b"\n" + secret.strip() + b"\n")
    assert load_auth_key(str(path)) == key
    path.write_bytes(secret.strip() + b"!")
    assert load_auth_key(str(path)) != key


def test_missing_key_file_names_the_variable(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-key")
    with pytest.raises(ValueError) as excinfo:
        load_auth_key(missing)
    message = str(excinfo.value)
    assert f"VINEYARD_CACHE_AUTH_KEY_FILE={missing!r}" in message
    assert "cannot be read" in message and "allowed" in message


@pytest.mark.parametrize("secret", [b"", b"short", b"  fifteen bytes  \n"[:17]])
def test_short_secret_names_the_variable(tmp_path: Path, secret: bytes) -> None:
    path = tmp_path / "key"
    path.write_bytes(secret)
    assert len(secret.strip()) < 16
    with pytest.raises(ValueError) as excinfo:
        load_auth_key(str(path))
    message = str(excinfo.value)
    assert f"VINEYARD_CACHE_AUTH_KEY_FILE={str(path)!r}" in message
    assert f"holds {len(secret.strip())} bytes" in message
    assert "allowed: a secret of at least 16 bytes" in message
