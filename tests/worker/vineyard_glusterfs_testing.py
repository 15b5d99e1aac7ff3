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
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

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


def _ensure_glusterd() -> None:
    """Start glusterd unless it runs. It is left running: tests in other
    workers may be using it."""
    if _run("gluster", "--mode=script", "pool", "list").returncode == 0:
        return
    started = _run("glusterd")
    if started.returncode != 0:
        pytest.skip(f"glusterd does not start: {started.stderr.strip()}")
    deadline = time.monotonic() + 30
    while _run("gluster", "--mode=script", "pool", "list").returncode != 0:
        if time.monotonic() > deadline:
            pytest.skip("glusterd did not answer within 30 s")
        time.sleep(0.2)


@dataclass
class GlusterVolume:
    """A replica-2 volume on two local bricks, mounted at two folders (two
    clients, as two hosts), with the faults a distributed filesystem has."""

    name: str
    host: str
    bricks: tuple[Path, Path]
    mounts: tuple[Path, Path]

    def gluster(self, *args: str) -> str:
        done = _run("gluster", "--mode=script", *args)
        assert done.returncode == 0, f"gluster {' '.join(args)}: {done.stderr}"
        return done.stdout

    def set(self, option: str, value: str) -> None:
        self.gluster("volume", "set", self.name, option, value)

    def brick_pids(self) -> list[int | None]:
        """Per brick, its server's pid, or None while it is down."""
        status = ElementTree.fromstring(
            self.gluster("volume", "status", self.name, "--xml")
        )
        up = {
            node.findtext("path"): int(node.findtext("pid") or -1)
            for node in status.iter("node")
            if node.findtext("status") == "1"
        }
        return [up.get(str(brick)) for brick in self.bricks]

    def kill_brick(self, index: int) -> None:
        """The server of brick ``index`` dies (SIGKILL). Its pid file, which
        a rebooted server would not have, is removed: glusterd takes a
        stale one for a running brick and would not start it again."""
        pid = self.brick_pids()[index]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: self.brick_pids()[index] is None, "brick down")
        run_dir = Path("/var/run/gluster/vols") / self.name
        for pid_file in run_dir.glob(f"*{self.bricks[index].name}.pid"):
            pid_file.unlink(missing_ok=True)

    def start_bricks(self) -> None:
        """Start every brick that is down, and wait until all serve and
        every client has reconnected to them (clients retry every few
        seconds; until then a brick that is up serves no one)."""
        self.gluster("volume", "start", self.name, "force")
        _wait(lambda: None not in self.brick_pids(), "bricks up")

        def reconnected() -> bool:
            status = self.gluster("volume", "status", self.name, "clients")
            counts = re.findall(r"Clients connected : (\d+)", status)
            return len(counts) == len(self.bricks) and len(set(counts)) == 1

        _wait(reconnected, "clients reconnected")

    def wait_healed(self, timeout_s: float = 60.0) -> None:
        """Until self-heal left no entry to heal on any brick."""

        def healed() -> bool:
            info = self.gluster("volume", "heal", self.name, "info")
            return re.findall(r"Number of entries: (\S+)", info) == ["0", "0"]

        _wait(healed, "heal", timeout_s)

    def unmount_lazily(self, index: int) -> None:
        """The client's mount torn away (``umount -l``): its path is an
        empty local folder again."""
        done = _run("umount", "-l", str(self.mounts[index]))
        assert done.returncode == 0, done.stderr

    def kill_client(self, index: int) -> None:
        """The client process of mount ``index`` dies: every call on the
        mount fails with ENOTCONN until it is unmounted and mounted again."""
        found = _run("pgrep", "-f", f"glusterfs.*{self.mounts[index]}$")
        pids = [int(pid) for pid in found.stdout.split()]
        assert pids, f"no client process for {self.mounts[index]}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    def mount(self, index: int) -> None:
        """Mount the volume at mount ``index`` again (after a loss: a
        killed client's dead mount is unmounted first)."""
        _run("umount", "-l", str(self.mounts[index]))  # fails if not mounted
        source = f"{self.host}:/{self.name}"
        done = _run("mount", "-t", "glusterfs", source, str(self.mounts[index]))
        assert done.returncode == 0, done.stderr


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"GlusterFS: no {what} in {timeout_s} s"
        time.sleep(0.2)


@contextlib.contextmanager
def glusterfs_volume(base: Path) -> Iterator[GlusterVolume]:
    """A fresh replica-2 volume mounted at two folders under ``base``."""
    why = _missing()
    if why is not None:
        pytest.skip(f"GlusterFS: {why}")
    _ensure_glusterd()
    host = socket.gethostname()
    name = f"vlc{uuid.uuid4().hex[:8]}"
    # Bricks must not sit on the FUSE mounts' paths, nor below /tmp's
    # pytest folders that other workers clean: their own folder under base.
    bricks = (base / "bricks" / "b1", base / "bricks" / "b2")
    mounts = (base / "host-a", base / "host-b")
    for path in (*bricks, *mounts):
        path.mkdir(parents=True)
    created = _run(
        "gluster", "--mode=script", "volume", "create", name, "replica", "2",
        *(f"{host}:{b}" for b in bricks), "force",
    )  # fmt: skip
    if created.returncode != 0:
        pytest.skip(f"gluster volume create failed: {created.stdout}{created.stderr}")
    volume = GlusterVolume(name, host, bricks, mounts)
    try:
        done = _run("gluster", "--mode=script", "volume", "start", name)
        if done.returncode != 0:
            pytest.skip(f"gluster volume start failed: {done.stderr.strip()}")
        for mount in mounts:
            source = f"{host}:/{name}"
            done = _run("mount", "-t", "glusterfs", source, str(mount))
            if done.returncode != 0:
                pytest.skip(f"mount -t glusterfs failed: {done.stderr.strip()}")
        yield volume
    finally:
        for mount in mounts:
            if _run("umount", str(mount)).returncode != 0:
                _run("umount", "-l", str(mount))
        _run("gluster", "--mode=script", "volume", "stop", name, "force")
        _run("gluster", "--mode=script", "volume", "delete", name)


@contextlib.contextmanager
def glusterfs_mounts(base: Path) -> Iterator[tuple[Path, Path]]:
    """A fresh replica-2 volume mounted at two folders under ``base``."""
    with glusterfs_volume(base) as volume:
        yield volume.mounts
