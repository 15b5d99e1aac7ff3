# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""After a failed vineyard write the writer closes the temp file vineyard
leaked, and nothing else: the sweeper's thread of the same process walks
``__temp`` with directory descriptors (and may read files there) at that
moment; closing one of those would let its number be reused and the
sweeper later close someone else's file."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm.worker.vineyard.backend.write_errors import release_failed_temp_files
from vllm.worker.vineyard.storage.namespaces import TEMP_DIR


def vineyard_temp_name(pod_name: str | None, chunk: int = 0) -> Path:
    """Where vineyard writes a chunk of this process before renaming it:
    ``<pid>`` or ``<POD_NAME>/<pid>-<i>`` followed by the chunk's path
    (``aa/bb/cc/dd``)."""
    path = f"44/45/ad/{chunk:02x}"
    if pod_name is None:
        return Path(f"{os.getpid()}{path}")
    return Path(pod_name, f"{os.getpid()}-{chunk}{path}")


def open_file(path: Path, flags: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, flags | os.O_CREAT, 0o600)
    if flags & os.O_ACCMODE != os.O_RDONLY:
        os.write(fd, b"partial chunk")
    return fd


def open_on(fd: int) -> str | None:
    """What ``fd`` is open on, or ``None`` when it is closed."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


@pytest.fixture
def held() -> Iterator[dict[str, int]]:
    """Descriptors a test opens, closed at teardown if still its own."""
    fds: dict[str, int] = {}
    yield fds
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)


@pytest.mark.parametrize("pod_name", [None, "pod-a"], ids=["pid", "pod_name"])
def test_only_the_leaked_temp_file_is_released(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    held: dict[str, int],
    pod_name: str | None,
) -> None:
    """Under ``__temp``: a directory and a file the sweeper holds open
    (read-only), a file open for writing that is no vineyard temp file, and
    a temp file of a write that failed (open for writing, vineyard's name
    for this process). Only the last is closed and deleted; the others stay
    open on the same files."""
    if pod_name is None:
        monkeypatch.delenv("POD_NAME", raising=False)
    else:
        monkeypatch.setenv("POD_NAME", pod_name)
    temp = tmp_path / "ns" / TEMP_DIR
    leaked_path = temp / vineyard_temp_name(pod_name, 1)
    read_path = temp / vineyard_temp_name(pod_name, 2)
    held["leaked"] = open_file(leaked_path, os.O_WRONLY)
    held["file"] = open_file(read_path, os.O_RDONLY)
    held["dir"] = os.open(leaked_path.parent, os.O_RDONLY | os.O_DIRECTORY)
    held["top"] = os.open(temp, os.O_RDONLY | os.O_DIRECTORY)
    held["other"] = open_file(temp / "notes" / "log.txt", os.O_WRONLY)
    kept = {k: os.fstat(fd) for k, fd in held.items() if k != "leaked"}

    assert release_failed_temp_files(str(temp)) == 1
    assert not leaked_path.exists()  # a partial file: written anew later
    for name, st in kept.items():
        now = os.fstat(held[name])  # still open ...
        assert (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)  # ... on it
    assert read_path.exists() and (temp / "notes" / "log.txt").exists()
    assert open_on(held.pop("leaked")) != str(leaked_path)  # closed


def test_a_leaked_temp_file_already_deleted_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: dict[str, int]
) -> None:
    """A leaked temp file someone deleted still holds its space until its
    descriptor is closed: it is closed too."""
    monkeypatch.delenv("POD_NAME", raising=False)
    temp = tmp_path / TEMP_DIR
    path = temp / vineyard_temp_name(None)
    held["leaked"] = open_file(path, os.O_RDWR)
    path.unlink()
    assert release_failed_temp_files(str(temp)) == 1
    assert open_on(held.pop("leaked")) != f"{path} (deleted)"  # closed
