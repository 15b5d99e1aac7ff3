# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A passthrough FUSE filesystem that makes a cache root slow, thin, faulty
or frozen, as a remote filesystem can be: every ``stat`` (getattr) and
``open``/``create`` waits ``--latency-ms`` first; with ``--io-latency-ms``
the first ``read`` of each open file (the round trip before the first byte;
later reads are read ahead) and every ``fsync`` (a commit on the server)
wait too; with ``--read-mbps`` every read shares one link of that many
MB/s (``--direct-io``, implied: every read reaches the daemon, none is
answered from the kernel's page cache; the bytes that crossed it are kept
in ``--stats-file``); while ``--freeze-file`` exists every operation blocks
(a server that stops answering).

    python benchmarks/vineyard/slow_fs.py BACKING_DIR MOUNTPOINT \
        [--latency-ms 20] [--io-latency-ms 20] [--read-mbps 16] \
        [--direct-io] [--freeze-file PATH] [--control-file PATH] \
        [--stats-file PATH] [--cores 1,2]

The control file (JSON, written whole by :meth:`SlowFs.set`) changes them
while mounted: ``latency_ms``, ``io_latency_ms``, ``read_mbps`` (0: no
cap; mount with ``--direct-io`` to cap later) and ``eio`` (paths below the
mount whose files fail every read with EIO, as a file in split-brain does;
a file put at such a path later reads fine).

Runs in the foreground until unmounted (``fusermount3 -u MOUNTPOINT``) or
killed. Needs ``/dev/fuse``, Debian's ``fuse3`` and ``mfusepy`` (PyPI).
:class:`SlowFs` mounts one for ``benchmark_serve.py`` and the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

try:
    import mfusepy as fuse
except (ImportError, OSError) as e:  # no libfuse: SlowFs says why
    fuse = None
    _IMPORT_ERROR = f"mfusepy unusable: {e}"

# st_ino too: a network filesystem's inode numbers are stable (FUSE's own
# node ids change whenever the kernel forgets an entry).
_STAT_FIELDS = (
    "st_ino", "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks"
)  # fmt: skip
#: How often the daemon writes down the bytes read through its link.
STATS_INTERVAL_S = 0.1
#: utimensat's special nanosecond values (as FUSE passes them, in ns).
_UTIME_NOW, _UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
_TIME_FIELDS = ("st_atime", "st_mtime", "st_ctime")


def fuse_unavailable() -> str | None:
    """Why a FUSE filesystem cannot be mounted here, or ``None``."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (Debian package fuse3)"
    if fuse is None:
        return _IMPORT_ERROR
    return None


def other_cores() -> set[int] | None:
    """The cores this process may not run on (``None``: it may use all)."""
    with contextlib.suppress(AttributeError, OSError):
        return (set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)) or None
    return None


class SlowFs:
    """This script mounted (in a process of its own) over ``work/backing``
    at ``work/mount``; :meth:`freeze` stops and resumes it. Without kernel
    caching a ``stat`` of a file is two calls here (lookup, getattr), so it
    costs about twice ``latency_ms`` (:meth:`stat_latency_ms` measures)."""

    def __init__(
        self,
        work: Path,
        latency_ms: float = 0.0,
        io_latency_ms: float = 0.0,
        read_mbps: float = 0.0,
        direct_io: bool = False,
        cores: set[int] | None = None,
    ):
        """``cores``: where the daemon runs, every thread of it (e.g. off
        the engines' cores, as a kernel client's work would be)."""
        self.backing = work / "backing"
        self.mount = work / "mount"
        self.freeze_file = work / "freeze"
        self.control_file = work / "control.json"
        self.stats_file = work / "stats.json"
        self.backing.mkdir(parents=True)
        self.mount.mkdir(parents=True)
        self._log = open(work / "fuse.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(self.backing),
             str(self.mount), "--latency-ms", str(latency_ms), "--io-latency-ms",
             str(io_latency_ms), "--read-mbps", str(read_mbps), "--freeze-file",
             str(self.freeze_file), "--control-file", str(self.control_file),
             "--stats-file", str(self.stats_file),
             *(["--direct-io"] if direct_io or read_mbps else []),
             *(["--cores", ",".join(map(str, sorted(cores)))] if cores else [])],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mount):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the FUSE filesystem did not mount")
            time.sleep(0.1)

    def freeze(self, on: bool) -> None:
        if on:
            self.freeze_file.touch()
        else:
            self.freeze_file.unlink(missing_ok=True)

    def set(self, **control: Any) -> None:
        """Change ``latency_ms``, ``io_latency_ms``, ``read_mbps`` or
        ``eio`` (paths below :attr:`mount`) from the next operation on."""
        doc = (
            json.loads(self.control_file.read_text())
            if self.control_file.exists()
            else {}
        )
        doc.update(control)
        doc["eio"] = [os.path.relpath(p, self.mount) for p in doc.get("eio", [])]
        tmp = self.control_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.control_file)

    def link_bytes(self) -> int:
        """The bytes read through the read link so far (as the daemon last
        wrote them down: it does every :data:`STATS_INTERVAL_S`)."""
        time.sleep(2 * STATS_INTERVAL_S)
        try:
            return int(json.loads(self.stats_file.read_text())["link_bytes"])
        except (OSError, ValueError, KeyError):
            return 0

    def stat_latency_ms(self, repeats: int = 5) -> float:
        """What one ``stat`` of a file costs through the mount (ms)."""
        probe = self.mount / "stat-probe"
        probe.write_bytes(b"x")
        start = time.perf_counter()
        for _ in range(repeats):
            os.stat(probe)
        took = (time.perf_counter() - start) / repeats
        probe.unlink()
        return 1e3 * took

    def close(self) -> None:
        self.freeze(False)
        subprocess.run(
            ["fusermount3", "-u", "-z", str(self.mount)],
            check=False,
            capture_output=True,
        )
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class SlowPassthrough(fuse.Operations if fuse else object):  # type: ignore[misc]
    use_ns = True

    def __init__(
        self,
        backing: str,
        latency_s: float,
        io_latency_s: float,
        freeze_file: str,
        read_mbps: float = 0.0,
        control_file: str = "",
        stats_file: str = "",
    ):
        self.backing = os.path.realpath(backing)
        self.latency_s = latency_s
        self.io_latency_s = io_latency_s
        self.read_bps = read_mbps * 1e6
        self.eio: set[int] = set()  # inodes of the files that fail reads
        self.freeze_file = freeze_file
        self.control_file = control_file
        self._control_mtime = 0
        self._read_from: set[int] = set()  # open files read from (not again slow)
        # The read link: when it is free again (monotonic).
        self._link_lock = threading.Lock()
        self._link_free_at = 0.0
        self.link_bytes = 0
        if stats_file:
            threading.Thread(
                target=self._write_stats, args=(stats_file,), daemon=True
            ).start()

    def _path(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _follow_control(self) -> None:
        try:
            mtime = os.stat(self.control_file).st_mtime_ns
        except OSError:
            return
        if mtime == self._control_mtime:
            return
        self._control_mtime = mtime
        with contextlib.suppress(OSError, ValueError):
            with open(self.control_file) as f:
                doc = json.load(f)
            self.latency_s = doc.get("latency_ms", self.latency_s * 1e3) / 1e3
            self.io_latency_s = doc.get("io_latency_ms", self.io_latency_s * 1e3) / 1e3
            self.read_bps = doc.get("read_mbps", self.read_bps / 1e6) * 1e6
            self.eio = set()
            for path in doc.get("eio", []):
                with contextlib.suppress(OSError):
                    self.eio.add(os.lstat(self._path(path)).st_ino)

    def _gate(self, slow: bool, latency_s: float | None = None) -> None:
        while self.freeze_file and os.path.exists(self.freeze_file):
            time.sleep(0.05)
        if self.control_file:
            self._follow_control()
        latency_s = self.latency_s if latency_s is None else latency_s
        if slow and latency_s:
            time.sleep(latency_s)

    def _write_stats(self, path: str) -> None:
        written = -1
        while True:
            time.sleep(STATS_INTERVAL_S)
            if self.link_bytes != written:
                written = self.link_bytes
                with contextlib.suppress(OSError):
                    with open(path + ".tmp", "w") as f:
                        json.dump({"link_bytes": written}, f)
                    os.replace(path + ".tmp", path)

    def _through_the_link(self, nbytes: int) -> None:
        """Wait for ``nbytes`` to cross the shared read link."""
        with self._link_lock:
            self.link_bytes += nbytes
            if not self.read_bps:
                return
            now = time.monotonic()
            self._link_free_at = max(now, self._link_free_at) + nbytes / self.read_bps
            done_at = self._link_free_at
        time.sleep(max(0.0, done_at - time.monotonic()))

    # ---- metadata (slow) ---------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._path(path))
        except OSError:
            self._gate(slow=True)  # a miss is a round trip too
            raise
        # Directories answer at once (a remote client caches them); files,
        # such as the cache's chunks, take the round trip.
        self._gate(slow=not os.path.isdir(self._path(path)))
        attrs: dict[str, Any] = {k: getattr(st, k) for k in _STAT_FIELDS}
        for k in _TIME_FIELDS:
            attrs[k] = getattr(st, k + "_ns")
        return attrs

    def open(self, path: str, flags: int) -> int:
        self._gate(slow=True)
        return os.open(self._path(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        self._gate(slow=True)
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    # ---- the rest (frozen only) ----------------------------------------------

    def access(self, path: str, amode: int) -> int:
        self._gate(slow=False)
        if not os.access(self._path(path), amode):
            raise PermissionError(13, "access denied")
        return 0

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        # With each entry's inode (use_ino): an entry without one (d_ino 0)
        # is skipped by readdir(3), and the folder lists empty.
        self._gate(slow=False)
        entries = []
        with os.scandir(self._path(path)) as found:
            for entry in found:
                st = entry.stat(follow_symlinks=False)
                attrs = {"st_ino": st.st_ino, "st_mode": st.st_mode}
                entries.append((entry.name, attrs, 0))
        return entries

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        first = fh not in self._read_from
        self._read_from.add(fh)
        self._gate(slow=first, latency_s=self.io_latency_s)
        if self.eio and os.fstat(fh).st_ino in self.eio:
            raise OSError(errno.EIO, "injected I/O error")
        data = os.pread(fh, size, offset)
        self._through_the_link(len(data))
        return data

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._gate(slow=False)
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._gate(slow=False)
        os.truncate(self._path(path), length)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._gate(slow=True, latency_s=self.io_latency_s)
        os.fdatasync(fh) if datasync else os.fsync(fh)
        return 0

    def release(self, path: str, fh: int) -> int:
        self._read_from.discard(fh)
        os.close(fh)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self._gate(slow=False)
        os.mkdir(self._path(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._gate(slow=False)
        os.rmdir(self._path(path))
        return 0

    def unlink(self, path: str) -> int:
        self._gate(slow=False)
        os.unlink(self._path(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        self._gate(slow=False)
        os.rename(self._path(old), self._path(new))
        return 0

    def link(self, target: str, source: str) -> int:
        # A new name ``target`` for the file ``source`` (the cache links a
        # settings file into place where it must not replace one).
        self._gate(slow=False)
        os.link(self._path(source), self._path(target))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._gate(slow=False)
        os.chmod(self._path(path), mode)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._gate(slow=False)
        if times is None:
            os.utime(self._path(path))
            return 0
        st, now = os.lstat(self._path(path)), time.time_ns()
        current = (st.st_atime_ns, st.st_mtime_ns)
        os.utime(
            self._path(path),
            ns=tuple(  # type: ignore[arg-type]
                now if t == _UTIME_NOW else old if t == _UTIME_OMIT else t
                for t, old in zip(times, current, strict=True)
            ),
        )
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        self._gate(slow=False)
        st = os.statvfs(self._path(path))
        fields = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                  "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")  # fmt: skip
        return {k: getattr(st, k) for k in fields}


def main() -> None:
    assert fuse is not None, fuse_unavailable()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backing")
    parser.add_argument("mountpoint")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--io-latency-ms", type=float, default=0.0)
    parser.add_argument("--read-mbps", type=float, default=0.0)
    parser.add_argument("--freeze-file", default="")
    parser.add_argument("--control-file", default="")
    parser.add_argument("--stats-file", default="")
    parser.add_argument("--direct-io", action="store_true")
    parser.add_argument("--cores", default="", help="e.g. 1,2: run only there")
    args = parser.parse_args()
    if args.cores:
        # Before the mount: every thread libfuse starts inherits it.
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    fuse.FUSE(
        SlowPassthrough(
            args.backing,
            args.latency_ms / 1e3,
            args.io_latency_ms / 1e3,
            args.freeze_file,
            args.read_mbps,
            args.control_file,
            args.stats_file,
        ),
        args.mountpoint,
        foreground=True,
        nothreads=False,
        allow_other=False,
        # Every stat must reach us (no kernel attribute cache); with a read
        # link, every read too (no page cache in front of it).
        attr_timeout=0,
        entry_timeout=0,
        use_ino=True,
        direct_io=args.direct_io or args.read_mbps > 0,
    )


if __name__ == "__main__":
    main()
