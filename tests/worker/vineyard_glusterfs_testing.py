# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real distributed filesystem for tests: a GlusterFS replica-2 volume on
two local bricks, mounted twice with FUSE, as two hosts would mount it (each
mount is its own client, with its own caches and locks).

Needs Debian's ``glusterfs-server`` and ``glusterfs-client`` (installed by
``tools/setup_env.sh`` where it may), root and ``/dev/fuse``; otherwise
:func:`glusterfs_mounts` skips with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _run(*cmd: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a command; one that hangs counts as failed (exit code 124)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(
            cmd, 124, "", f"timed out after {timeout_s} s"
        )


def _missing() -> str | None:
    """Why GlusterFS cannot run here, or None."""
    for tool in ("glusterd", "gluster", "mount.glusterfs"):
        if shutil.which(tool) is None:
            return (
                f"{tool} is not installed (Debian: glusterfs-server, glusterfs-client)"
            )
    if os.geteuid() != 0:
        return "mounting GlusterFS needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def _ensure_glusterd() -> bool:
    """Start glusterd unless it runs; whether this call started it."""
    if _run("gluster", "--mode=script", "pool", "list").returncode == 0:
        return False
    started = _run("glusterd")
    if started.returncode != 0:
        pytest.skip(f"glusterd does not start: {started.stderr.strip()}")
    deadline = time.monotonic() + 30
    while _run("gluster", "--mode=script", "pool", "list").returncode != 0:
        if time.monotonic() > deadline:
            pytest.skip("glusterd did not answer within 30 s")
        time.sleep(0.2)
    return True


@contextlib.contextmanager
def glusterfs_mounts(base: Path) -> Iterator[tuple[Path, Path]]:
    """A fresh replica-2 volume mounted at two folders under ``base``."""
    why = _missing()
    if why is not None:
        pytest.skip(f"GlusterFS: {why}")
    started = _ensure_glusterd()
    host = socket.gethostname()
    volume = f"vlc{uuid.uuid4().hex[:8]}"
    # Bricks must not sit on the FUSE mounts' paths, nor below /tmp's
    # pytest folders that other workers clean: their own folder under base.
    bricks = [base / "bricks" / f"b{i}" for i in (1, 2)]
    mounts = (base / "host-a", base / "host-b")
    for path in (*bricks, *mounts):
        path.mkdir(parents=True)
    created = _run(
        "gluster", "--mode=script", "volume", "create", volume, "replica", "2",
        *(f"{host}:{b}" for b in bricks), "force",
    )  # fmt: skip
    if created.returncode != 0:
        pytest.skip(f"gluster volume create failed: {created.stdout}{created.stderr}")
    mounted: list[Path] = []
    try:
        done = _run("gluster", "--mode=script", "volume", "start", volume)
        if done.returncode != 0:
            pytest.skip(f"gluster volume start failed: {done.stderr.strip()}")
        for mount in mounts:
            done = _run("mount", "-t", "glusterfs", f"{host}:/{volume}", str(mount))
            if done.returncode != 0:
                pytest.skip(f"mount -t glusterfs failed: {done.stderr.strip()}")
            mounted.append(mount)
        yield mounts
    finally:
        for mount in mounted:
            if _run("umount", str(mount)).returncode != 0:
                _run("umount", "-l", str(mount))
        _run("gluster", "--mode=script", "volume", "stop", volume, "force")
        _run("gluster", "--mode=script", "volume", "delete", volume)
        if started:
            _run("pkill", "-x", "glusterd")
