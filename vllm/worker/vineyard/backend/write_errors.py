# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Why a vineyard write failed, and the temp files a failed write leaks:
vineyard reports neither, so the writer backend asks the filesystem.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_error_reason(path: str, need_bytes: int, leaked_files: int = 1) -> str | None:
    """Why a write failed: vineyard swallows the errno, so ask the
    filesystem what it most likely was. ``None``: not the filesystem.

    A write that failed in the filesystem leaves vineyard's temp file open
    (``leaked_files``). A failure with neither a leaked file nor a full or
    unwritable root is a race with another process on the same root (a
    writer of the same chunks, a sweeper evicting the prefix and another
    writer putting it back): vineyard has no locking. That is a refusal,
    not an error: the chunk is someone else's to write or is written again
    when a request needs it."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"cache root unusable ({e})"
    if not os.path.isdir(path):
        return "cache root unusable (not a directory)"
    if st.f_bavail * st.f_frsize < need_bytes:
        return "no space left on device (ENOSPC)"
    if not os.access(path, os.W_OK):
        return "cache root not writable"
    if not leaked_files:
        # A filesystem can refuse what the mode bits allow (a volume its
        # servers set read-only: EROFS at open): try it.
        return _cannot_create_in(path)
    return "write failed (I/O error or quota; vineyard does not report errno)"


def _cannot_create_in(path: str) -> str | None:
    """Why no file can be created in ``path``, or ``None`` if one can."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
    except OSError as e:
        return f"cache root not writable ({e.strerror or e})"
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def release_failed_temp_files(temp_dir: str) -> int:
    """Close and delete the temp files of writes that failed.

    When a chunk write fails (ENOSPC, EIO), vineyard returns without closing
    the temp file it was writing: the descriptor leaks, and with it the
    space the partial file holds, even after the file is deleted. On a disk
    that stays full, one leaks per failed chunk until the process runs out
    of descriptors (and then cannot read either). Vineyard opens and closes
    every file within a call, so after ``update`` returns any descriptor of
    this process still open on a file under its temp folder is such a leak.
    Returns how many were released."""
    prefix = temp_dir.rstrip(os.sep) + os.sep
    released = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0  # no procfs: nothing to find
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith(prefix):
            continue
        try:
            os.close(int(name))
        except OSError:
            continue
        released += 1
        path = target.removesuffix(" (deleted)")
        if path != target:
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)  # a partial file: the retry writes it anew
    return released
