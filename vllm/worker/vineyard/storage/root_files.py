# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The files a cache root holds for its upkeep, beside its namespaces
(:data:`ROOT_FILES`): the sweepers' lock (``flock``: one process walks the
root at a time), their usage ledger (:class:`Usage`: what writers share
between walks), their clock probe (:func:`root_clock`: the time by the
clock that stamps the root's mtimes) and the root's own settings
(:class:`RootSettings`: its disk limit and TTL, whoever sweeps it). All are
opened without following links and without blocking; none is ever
removed.

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
import struct
import time
from dataclasses import dataclass

from vllm.worker.vineyard.config import MAX_TTL_S
from vllm.worker.vineyard.storage.file_modes import OWNER_ONLY, FileModes
from vllm.worker.vineyard.storage.safe_io import (
    NO_LINK_NO_BLOCK,
    NotRegularFileError,
    read_json,
    write_json,
)

SWEEP_LOCK = "__sweep.lock"
USAGE_LEDGER = "__sweep.ledger"
ROOT_SETTINGS = "__settings.json"
CLOCK_PROBE = "__sweep.clock"
#: The files every sweep makes or keeps up.
SWEEPER_FILES = (SWEEP_LOCK, USAGE_LEDGER, ROOT_SETTINGS, CLOCK_PROBE)
#: The blocks per chunk of instances that set no chunk size (``chunking``).
CHUNKING = "__chunking.json"
ROOT_FILES = (*SWEEPER_FILES, CHUNKING)
#: Largest settings file read (a real one is well under 1 KiB).
MAX_SETTINGS_BYTES = 1 << 16

_SETTINGS_TEMP = re.compile(re.escape(ROOT_SETTINGS) + r"\.[A-Za-z0-9_]+\.tmp")


def is_root_file(name: str) -> bool:
    """Whether ``name``, in the root, is one of these files (or a settings
    file being written)."""
    return name in ROOT_FILES or _SETTINGS_TEMP.fullmatch(name) is not None


# --------------------------------------------------------------------------
# The sweepers' files.
# --------------------------------------------------------------------------


def open_root_file(root: str, name: str, writable: bool = False) -> int:
    """Open one of :data:`ROOT_FILES` in ``root``, creating it (as private
    as the chunk files). Never follows a link and never blocks (a FIFO
    planted there does not hang a sweeper); raises ``OSError`` when it
    cannot be opened or is not a regular file."""
    assert name in ROOT_FILES
    flags = os.O_CREAT | NO_LINK_NO_BLOCK | (os.O_RDWR if writable else os.O_RDONLY)
    fd = os.open(os.path.join(root, name), flags, 0o660)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def flock_within(fd: int, wait_s: float, poll_s: float) -> bool:
    """Take ``flock`` on ``fd``, waiting up to ``wait_s``; whether it is
    held. Raises ``OSError`` on a filesystem without locks."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def root_clock(root: str) -> float:
    """Now by the clock that stamps the root's mtimes: the new mtime of
    :data:`CLOCK_PROBE`, touched to "now" (on a network filesystem the
    server sets it, by its own clock, as it sets every mtime there). Raises
    ``OSError`` when the probe cannot be touched (a read-only root)."""
    fd = open_root_file(root, CLOCK_PROBE, writable=True)
    try:
        os.utime(fd)
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)


@dataclass
class Usage:
    """The root's usage as its writers share it (:data:`USAGE_LEDGER`): the
    chunk bytes the last sweep left, plus what writers reserved since."""

    base: int = 0  # chunk bytes on disk after the last sweep
    chunks: int = 0  # chunk files on disk after the last sweep
    pending: int = 0  # bytes writers reserved since that sweep's scan began
    epoch: int = 0  # sweeps so far (a reservation is given back in its own)
    stamp: float = 0.0  # when the last sweep ended (0: none yet)


_LEDGER = struct.Struct("<8sqqqqd")
_LEDGER_MAGIC = b"vlcusage"
_LEDGER_MAX = 1 << 62


def read_ledger(fd: int) -> Usage | None:
    """The ledger's :class:`Usage`, or ``None`` when it is new, unreadable
    or not a ledger (the next sweep writes it anew)."""
    try:
        raw = os.pread(fd, _LEDGER.size, 0)
    except OSError:
        return None
    if len(raw) != _LEDGER.size:
        return None
    magic, base, chunks, pending, epoch, stamp = _LEDGER.unpack(raw)
    if (
        magic != _LEDGER_MAGIC
        or not all(0 <= n < _LEDGER_MAX for n in (base, chunks, pending, epoch))
        or not 0.0 <= stamp < float(_LEDGER_MAX)
    ):
        return None
    return Usage(base, chunks, pending, epoch, stamp)


def write_ledger(fd: int, usage: Usage) -> None:
    """Write ``usage`` in place (one small write; raises ``OSError``)."""
    os.pwrite(
        fd,
        _LEDGER.pack(
            _LEDGER_MAGIC,
            *(
                min(max(n, 0), _LEDGER_MAX - 1)
                for n in (usage.base, usage.chunks, usage.pending)
            ),
            usage.epoch % _LEDGER_MAX,
            usage.stamp,
        ),
        0,
    )


# --------------------------------------------------------------------------
# The root's own settings.
# --------------------------------------------------------------------------

#: Most a root's disk limit may be (1 EiB). Deliberately bounded, unlike
#: VINEYARD_CACHE_DISK_LIMIT_GB (which has no upper bound): any host that
#: shares the root can write this file, so what a sweeper takes from it is
#: held to a sane range. The TTL's bound is the setting's own (MAX_TTL_S).
MAX_LIMIT_BYTES = 1 << 60


@dataclass(frozen=True)
class RootSettings:
    """What governs a root's upkeep, whichever process sweeps it
    (:data:`ROOT_SETTINGS`): recorded by the first process that sweeps the
    root, changed only on purpose (``vineyard-llm-cache settings``), so
    that one instance with a small limit or TTL cannot shrink everyone's
    cache."""

    disk_limit_bytes: int
    ttl_s: float  # 0: chunks never expire

    def __post_init__(self) -> None:
        limit, ttl = self.disk_limit_bytes, self.ttl_s
        if type(limit) is not int or not 0 < limit <= MAX_LIMIT_BYTES:
            raise ValueError(
                f"disk_limit_bytes={limit!r}; allowed: an integer in "
                f"[1, {MAX_LIMIT_BYTES}]"
            )
        if type(ttl) not in (int, float) or not 0 <= ttl <= MAX_TTL_S:
            raise ValueError(f"ttl_s={ttl!r}; allowed: a number in [0, {MAX_TTL_S:g}]")

    def describe(self) -> str:
        ttl = f"{self.ttl_s:g} s" if self.ttl_s else "none"
        return f"disk limit {self.disk_limit_bytes / (1 << 30):g} GiB, TTL {ttl}"


def read_root_settings(root: str) -> RootSettings | None:
    """The root's recorded settings, or ``None`` where none are. Raises
    ``ValueError`` when the file holds no valid settings and ``OSError``
    when it cannot be read (never follows a link, never blocks)."""
    try:
        doc = read_json(os.path.join(root, ROOT_SETTINGS), MAX_SETTINGS_BYTES)
        return RootSettings(doc["disk_limit_bytes"], doc["ttl_s"])
    except FileNotFoundError:
        return None
    except NotRegularFileError:
        raise
    except (ValueError, KeyError) as e:
        raise ValueError(f"{ROOT_SETTINGS} holds no valid settings: {e}") from e


def record_root_settings(
    root: str,
    settings: RootSettings,
    replace: bool = False,
    modes: FileModes = OWNER_ONLY,
) -> RootSettings:
    """Record ``settings`` as the root's and return what is recorded now.
    Unless ``replace``, settings recorded before stay (the first recorder
    wins). Written to a temporary file and linked (or renamed) into place,
    so no reader sees half a file, with ``modes.file_mode``. Raises
    ``OSError`` when it cannot."""
    doc = {
        "disk_limit_bytes": settings.disk_limit_bytes,
        "ttl_s": settings.ttl_s,
        "recorded_at": time.time(),
        "recorded_by": f"{socket.gethostname()} pid {os.getpid()}",
    }
    write_json(root, ROOT_SETTINGS, doc, modes, replace)
    if replace:
        return settings
    return read_root_settings(root) or settings
