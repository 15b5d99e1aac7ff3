# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Safe file I/O on a cache root that others may share: how files and
directories are opened (never following a link, never blocking), the read
of a small JSON file, its atomic write, and the space a file takes.

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from typing import Any

from vllm.worker.vineyard.storage.file_modes import FileModes

#: How every file is opened: never following a link, never blocking (a
#: FIFO planted at a chunk path must not hang a reader).
NO_LINK_NO_BLOCK = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: How a file is opened for reading.
OPEN_FILE = os.O_RDONLY | NO_LINK_NO_BLOCK
#: How a directory below the root is opened: never following a link.
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: How the root itself is opened, to walk or remove below it: the one
#: directory reached through a link (a root given through one, as the
#: cache resolves it too).
OPEN_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class NotRegularFileError(ValueError):
    """Something other than a regular file where one was to be read."""


def read_json(path: str, max_bytes: int, dir_fd: int | None = None) -> dict[str, Any]:
    """The JSON object in the small regular file ``path`` (relative to
    ``dir_fd`` when given). Raises ``OSError`` when it cannot be opened or
    read (``FileNotFoundError`` when absent, also through a link: never
    followed), :class:`NotRegularFileError` when it is no regular file, and
    ``ValueError`` saying why when it is larger than ``max_bytes`` or holds
    no JSON object.

    Read again once where a network filesystem answers ``ESTALE``: another
    client replaced the file meanwhile, and a new lookup of the path finds
    the new one."""
    try:
        raw = _read_small_file(path, max_bytes, dir_fd)
    except OSError as e:
        if e.errno != errno.ESTALE:
            raise
        raw = _read_small_file(path, max_bytes, dir_fd)
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def _read_small_file(path: str, max_bytes: int, dir_fd: int | None) -> bytes:
    fd = os.open(path, OPEN_FILE, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{os.path.basename(path)} is not a regular file")
        if st.st_size > max_bytes:
            raise ValueError("too large")
        raw = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise ValueError("too large")
    return raw


def write_json(
    directory: str,
    name: str,
    doc: dict[str, Any],
    modes: FileModes,
    replace: bool = True,
) -> None:
    """Write ``doc`` as the file ``name`` in ``directory`` so that no reader
    sees half of it: to a temporary file (``name.XXXX.tmp``, synced), then
    renamed into place, or with ``replace=False`` linked into place unless
    a file is there already (which then stays). As private as the chunk
    files (the backend's umask): ``modes.file_mode``. Raises ``OSError``
    when it cannot."""
    path = os.path.join(directory, name)
    fd, temp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=directory)
    renamed = False
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), modes.file_mode)
            json.dump(doc, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(temp, path)
            renamed = True
        else:
            with contextlib.suppress(FileExistsError):
                os.link(temp, path)
    finally:
        if not renamed:  # a second name of the file, or a failed write
            with contextlib.suppress(OSError):
                os.unlink(temp)


def release(fd: int) -> None:
    """Close ``fd`` (releasing its ``flock``). Linux frees the descriptor
    even when ``close`` reports an error (a FUSE mount whose client died:
    ENOTCONN), so that error is no reason to fail the caller."""
    with contextlib.suppress(OSError):
        os.close(fd)


def disk_bytes(st: os.stat_result) -> int:
    """The space a file takes: whole filesystem blocks (at least its size,
    for filesystems that report blocks late)."""
    return max(st.st_size, st.st_blocks * 512)
