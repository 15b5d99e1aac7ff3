# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Settings of the vineyard LLM cache: one table, parsed once, validated at
startup.

Every setting is one field of :class:`VineyardLLMCacheConfig`, written once
with its default, help text and parser. It is read from the environment
variable ``VINEYARD_CACHE_<FIELD>`` and, for users of
``--kv-transfer-config``, from ``kv_connector_extra_config`` under the key
``<field>`` (the variable's name without ``VINEYARD_CACHE_``, lower case).
``kv_connector_extra_config`` wins over the environment. A bad value raises
``ValueError`` naming the setting, the value and what is allowed.

This module imports nothing heavy: the plugin entry point, which every vLLM
process loads, uses it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

ENABLE_VAR = "VLLM_USE_VINEYARD_CACHE"
ENV_PREFIX = "VINEYARD_CACHE_"
GiB = 1 << 30
#: Most VINEYARD_CACHE_TTL_S may be (also in a root's own settings file).
MAX_TTL_S = 1e9
#: Most read-ahead buffers a worker may be given (the setting's maximum).
READ_AHEAD_BUFFERS_MAX = 64

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_ALLOWED = "1 or 0 (also true/false, yes/no, on/off)"

Parser = Callable[[str, str], Any]


def parse_bool(name: str, raw: str) -> bool:
    value = str(raw).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; allowed: {BOOL_ALLOWED}")


def _number(
    kind: type, low: float, low_inclusive: bool, high: float | None
) -> tuple[Parser, str]:
    """A parser for a number in ``[low, high]`` (or ``(low, high]``), and
    the text of what it allows."""
    what = "an integer" if kind is int else "a number"
    allowed = (
        f"{what} in {'[' if low_inclusive else '('}{low}, "
        f"{'inf' if high is None else high}]"
    )

    def parse(name: str, raw: str) -> Any:
        try:
            value = kind(str(raw).strip())
        except ValueError:
            raise ValueError(
                f"{name}={raw!r} is not valid; allowed: {allowed}"
            ) from None
        if (
            (isinstance(value, float) and not math.isfinite(value))
            or value < low
            or (value == low and not low_inclusive)
            or (high is not None and value > high)
        ):
            raise ValueError(f"{name}={raw!r} is out of range; allowed: {allowed}")
        return value

    return parse, allowed


def _path(optional: bool) -> tuple[Parser, str]:
    allowed = "a file path, or empty for none" if optional else "a directory path"

    def parse(name: str, raw: str) -> str:
        raw = str(raw).strip()
        if not raw:
            if optional:
                return ""
            raise ValueError(f"{name} is empty; allowed: {allowed}")
        return os.path.abspath(os.path.expanduser(raw))

    return parse, allowed


_BOOL = (parse_bool, BOOL_ALLOWED)
_POSITIVE_INT = _number(int, 1, True, None)
_POSITIVE = _number(float, 0, False, None)
_NON_NEGATIVE = _number(float, 0, True, None)


def _chunk_size() -> tuple[Parser, str]:
    allowed = "0 (one block) or a positive multiple of vLLM's block size"
    parse_int = _number(int, 0, True, None)[0]

    def parse(name: str, raw: str) -> int:
        try:
            return int(parse_int(name, raw))
        except ValueError:
            raise ValueError(
                f"{name}={raw!r} is not valid; allowed: {allowed}"
            ) from None

    return parse, allowed


_CHUNK_SIZE = _chunk_size()


def _choice(*values: str) -> tuple[Parser, str]:
    allowed = " or ".join(values)

    def parse(name: str, raw: str) -> str:
        value = str(raw).strip().lower()
        if value not in values:
            raise ValueError(f"{name}={raw!r} is not valid; allowed: {allowed}")
        return value

    return parse, allowed


def _setting(default: str, help: str, parser: tuple[Parser, str]) -> Any:
    """A config field: its default is ``default`` parsed, and the raw
    default, help text, parser and allowed range travel in its metadata."""
    parse, allowed = parser
    return field(
        default=parse("default", default),
        metadata={"raw_default": default, "help": help, "parse": parse,
                  "allowed": allowed},
    )  # fmt: skip


@dataclass(frozen=True)
class VineyardLLMCacheConfig:
    """The cache's settings (see the module docstring for where they come
    from). Construct it directly in tests and tools."""

    enabled: bool = _setting(
        "0",
        "1 turns the vineyard cache on for `vllm serve` and `LLM(...)` with no "
        "other flag.",
        _BOOL,
    )
    root: str = _setting(
        "/tmp/vineyard/llm_cache",
        "Directory of the cache (local disk, or a shared filesystem for "
        "several instances).",
        _path(optional=False),
    )
    chunk_size: int = _setting(
        "0",
        "Tokens per cached chunk (the unit of lookup and write, one file "
        "each); 0: chosen from the root's measured round trip and recorded in "
        "the root for every instance: one KV block on a local disk (hits and "
        "saves exact to the block), up to 8 on a root a network away.",
        _CHUNK_SIZE,
    )
    cpu_mem_limit_gb: float = _setting(
        "8", "CPU memory budget (GiB) of the cache's buffers on each worker.",
        _POSITIVE,
    )  # fmt: skip
    enable_async_update: bool = _setting(
        "1",
        "1: updates are written in the background; 0: the forward thread "
        "waits for every write.",
        _BOOL,
    )
    async_update_cpu_mem_util: float = _setting(
        "0.5",
        "Share of the memory limit given to the update buffer pool.",
        _number(float, 0, True, 1),
    )
    min_inflight_tasks: int = _setting(
        "1", "Fewest update buffers (allocated at startup).", _POSITIVE_INT
    )
    max_inflight_tasks: int = _setting(
        "4",
        "Most update buffers, i.e. updates in flight; when all are busy an "
        "update is skipped (and resumed later).",
        _POSITIVE_INT,
    )
    metrics_enabled: bool = _setting(
        "0", "1: also collect timing histograms (counters are always on).", _BOOL
    )
    disk_limit_gb: float = _setting(
        "100",
        "Most GiB the cache may use under its root, all instances and models "
        "together; least recently used chunks are evicted beyond it (and "
        "whenever the filesystem runs low on space). The first instance to "
        "sweep a root records it there; then the root's value governs.",
        _POSITIVE,
    )
    ttl_s: float = _setting(
        "0",
        "Seconds after its last use (write or hit) when a chunk expires; 0: "
        "never (the disk limit still applies). Recorded in the root like the "
        "disk limit.",
        _number(float, 0, True, MAX_TTL_S),
    )
    sweep_interval_s: float = _setting(
        "30",
        "Seconds between background sweeps of the root (usage, eviction, "
        "expiry, orphaned temp files and empty directories).",
        _number(float, 0.1, True, 86400),
    )
    auth_key_file: str = _setting(
        "",
        "File holding a secret shared by the instances that trust each other: "
        "stored chunks are authenticated with it (keyed BLAKE3) and chunks "
        "that do not verify are never loaded.",
        _path(optional=True),
    )
    group_access: bool = _setting(
        "0",
        "0: cache files and directories are readable only by their owner; 1: "
        "also by the owner's group (instances running as different users of "
        "one group).",
        _BOOL,
    )
    backend_timeout_s: float = _setting(
        "30",
        "Longest wait for one backend call before the backend is restarted and "
        "the call counted as failed.",
        _number(float, 0.1, True, 3600),
    )
    readers: int = _setting(
        "0",
        "Reader processes per worker: a load's segments are read and verified "
        "by several at once. 0: two where two cores are free for them (any "
        "two with a GPU; two the worker is not bound to on a CPU), else one.",
        _number(int, 0, True, 8),
    )
    read_ahead_buffers: int = _setting(
        "4",
        "Read buffers per worker (a quarter of a step's KV each) for the "
        "hits of queued requests, read while they wait so that their loads "
        "finish in the step that starts them; more (up to "
        f"{READ_AHEAD_BUFFERS_MAX}) where these hold less than 16 MiB. "
        "0: no read-ahead.",
        _number(int, 0, True, READ_AHEAD_BUFFERS_MAX),
    )
    lookup_timeout_s: float = _setting(
        "2",
        "Longest a lookup (file metadata, in the background) may take before "
        "the request is served as a miss; a hung filesystem costs hits, "
        "never the engine's progress.",
        _number(float, 0, False, 600),
    )
    load_policy: str = _setting(
        "auto",
        "auto: a hit is loaded only when loading it is expected to be faster "
        "than computing it (from live estimates of both; a slow link to the "
        "root costs no more than computing); always: every hit is loaded.",
        _choice("auto", "always"),
    )
    drain_timeout_s: float = _setting(
        "5",
        "At shutdown, how long pending updates may still be written before "
        "they are dropped.",
        _number(float, 0, True, 600),
    )
    #: Where each value came from (the key the user wrote), for errors
    #: found after parsing; settings not listed came from the environment.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.min_inflight_tasks > self.max_inflight_tasks:
            raise ValueError(
                f"{self.setting('min_inflight_tasks')}={self.min_inflight_tasks}"
                f" is greater than {self.setting('max_inflight_tasks')}="
                f"{self.max_inflight_tasks}; allowed: MIN <= MAX"
            )

    def setting(self, field_name: str) -> str:
        """How the user named a setting: its ``kv_connector_extra_config``
        key if it came from there, else its environment variable."""
        return self.sources.get(field_name, env_name(field_name))

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        extra_config: Mapping[str, Any] | None = None,
    ) -> VineyardLLMCacheConfig:
        """Parse the environment and ``kv_connector_extra_config`` (which
        wins); raises ``ValueError`` naming the setting."""
        environ = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for f in setting_fields():
            name, parse = env_name(f.name), f.metadata["parse"]
            if f.name in extra:
                sources[f.name] = f"kv_connector_extra_config[{f.name!r}]"
                values[f.name] = parse(sources[f.name], extra.pop(f.name))
            elif name in environ:
                values[f.name] = parse(name, environ[name])
        # The extra config is this connector's alone: a misspelt key must
        # not pass silently.
        unknown = sorted(extra)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown key(s) {unknown}; "
                f"allowed: {sorted(f.name for f in setting_fields())}"
            )
        return cls(**values, sources=sources)

    def chunk_tokens(self, block_size: int) -> int:
        """The chunk size in tokens for vLLM's ``block_size`` (one block
        unless set); raises ``ValueError`` naming the setting as the user
        wrote it if it splits blocks."""
        if self.chunk_size == 0:
            return block_size
        if self.chunk_size % block_size != 0:
            raise ValueError(
                f"{self.setting('chunk_size')}={self.chunk_size} is not a "
                f"multiple of the KV block size {block_size}; allowed: 0 (one "
                f"block) or a positive multiple of {block_size}"
            )
        return self.chunk_size

    def num_update_buffers(self, buffer_bytes: int) -> int:
        """``floor(UTIL * LIMIT / buffer_bytes)`` clamped to [MIN, MAX];
        raises when even MIN buffers do not fit the budget."""
        budget = self.async_update_cpu_mem_util * self.cpu_mem_limit_gb * GiB
        fits = int(budget // buffer_bytes)
        if fits < self.min_inflight_tasks:
            need_gb = self.min_inflight_tasks * buffer_bytes / GiB
            raise ValueError(
                f"{self.setting('async_update_cpu_mem_util')}="
                f"{self.async_update_cpu_mem_util} x "
                f"{self.setting('cpu_mem_limit_gb')}={self.cpu_mem_limit_gb} "
                f"gives {budget / GiB:.3f} GiB, too small for "
                f"{self.setting('min_inflight_tasks')}={self.min_inflight_tasks} "
                f"update buffer(s) of {buffer_bytes / (1 << 20):.1f} MiB each "
                f"(one step of KV); allowed: UTIL x LIMIT >= {need_gb:.3f} GiB "
                "(or fewer max_num_batched_tokens)"
            )
        return min(fits, self.max_inflight_tasks)


def setting_fields() -> list[Field[Any]]:
    """The fields that are settings (each has a parser)."""
    return [f for f in fields(VineyardLLMCacheConfig) if "parse" in f.metadata]


def env_name(field_name: str) -> str:
    """The environment variable of a config field."""
    return ENABLE_VAR if field_name == "enabled" else ENV_PREFIX + field_name.upper()


@dataclass(frozen=True)
class EnvVar:
    """One row of the documented settings table."""

    name: str
    key: str  # the field, and the kv_connector_extra_config key
    default: str
    allowed: str
    help: str


#: Every setting by environment variable (the docs' table is checked
#: against this one by a test).
ENV_VARS: dict[str, EnvVar] = {
    env_name(f.name): EnvVar(
        env_name(f.name),
        f.name,
        f.metadata["raw_default"],
        f.metadata["allowed"],
        f.metadata["help"],
    )
    for f in setting_fields()
}


def vineyard_cache_requested() -> bool:
    return parse_bool(ENABLE_VAR, os.environ.get(ENABLE_VAR, "0"))
