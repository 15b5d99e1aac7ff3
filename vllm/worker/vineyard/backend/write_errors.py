# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Why a vineyard write failed, and the temp files a failed write leaks:
vineyard reports neither, so the writer backend asks the filesystem.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
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
    of descriptors (and then cannot read either).

    Other threads of this process (the sweeper, removals) hold descriptors
    under ``temp_dir`` too, and close them themselves. So a descriptor is
    released only when it is proven vineyard's leak (:func:`_leaked_temp_file`):
    a regular file, open for writing, whose path is vineyard's temp-file name
    for this process. Nothing else in the process opens such a file for
    writing, and vineyard keeps no file open past a call but the temp file
    of a failed write (calls run one at a time). The proof is made on a duplicate of the
    descriptor, so it holds for one open file even if the number is closed
    and reused meanwhile; and a descriptor so proven is closed by no one
    else, so its number still names that file when it is closed here. (The
    numbers open before the call prove nothing more: the sweeper may close
    one during the call and vineyard's leak get that number.)
    Returns how many were released."""
    prefix = temp_dir.rstrip(os.sep) + os.sep
    pattern = _temp_file_pattern(os.getpid(), os.environ.get("POD_NAME"))
    released = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0  # no procfs: nothing to find
    for name in fds:
        target = _leaked_temp_file(int(name), prefix, pattern)
        if target is None:
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


#: A chunk's path below its namespace: 8 hex digits, flat or in folders
#: of 2.
_CHUNK_PATH = r"[0-9a-f]{2}(?:/?[0-9a-f]{2}){3}"


def _temp_file_pattern(pid: int, pod_name: str | None) -> re.Pattern[str]:
    """Vineyard's temp file for a chunk, below its temp folder, as process
    ``pid`` names it: ``<pid><chunk path>``, or with ``POD_NAME`` set
    ``<POD_NAME>/<pid>-<i><chunk path>`` (``i``: the chunk's index in the
    call)."""
    if pod_name:
        return re.compile(rf"{re.escape(pod_name)}/{pid}-[0-9]+{_CHUNK_PATH}")
    return re.compile(rf"{pid}{_CHUNK_PATH}")


def _leaked_temp_file(fd: int, prefix: str, pattern: re.Pattern[str]) -> str | None:
    """What ``fd`` is open on (``/proc`` naming, `` (deleted)`` and all) if
    it is vineyard's temp file below ``prefix``, open for writing; else
    ``None``. Checked on a duplicate of ``fd`` (one open file throughout)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None  # closed meanwhile
    try:
        if not stat.S_ISREG(os.fstat(dup).st_mode):
            return None
        with open(f"/proc/self/fdinfo/{dup}", encoding="ascii") as info:
            flags = next(
                int(line.split()[1], 8) for line in info if line.startswith("flags:")
            )
        if flags & os.O_ACCMODE == os.O_RDONLY:
            return None
        target = os.readlink(f"/proc/self/fd/{dup}")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    finally:
        os.close(dup)
    inside = target.removesuffix(" (deleted)").removeprefix(prefix)
    if inside == target or not pattern.fullmatch(inside):
        return None
    return target
