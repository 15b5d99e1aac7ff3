# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The link-free scan of a cache root (:func:`scan_root`), for everything
that walks a root: the sweeper (in the writer backend), the scheduler and
the command-line tool.

A root holds one directory per namespace (see
:mod:`~vllm.worker.vineyard.storage.namespaces`) and the files of its
upkeep (:mod:`~vllm.worker.vineyard.storage.root_files`). A scan sorts what
it finds into the cache's own chunk files, leftovers (temporary files and
placeholders) and directories, and what is not the cache's: files outside
namespaces or of another shape, links, devices, other filesystems mounted
inside. It reports the latter and deletes nothing. Scans follow no link
and cross no filesystem (removals:
:mod:`~vllm.worker.vineyard.storage.removal`).

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.worker.vineyard.storage.chunks import ChunkShape
from vllm.worker.vineyard.storage.namespaces import (
    MANIFEST,
    TEMP_DIR,
    Manifest,
    NamespaceName,
    is_manifest_temp,
    load_manifest,
    parse_namespace_name,
)
from vllm.worker.vineyard.storage.root_files import is_root_file
from vllm.worker.vineyard.storage.safe_io import (
    OPEN_DIR,
    OPEN_FILE,
    OPEN_ROOT,
    disk_bytes,
)

_HEX2 = re.compile(r"[0-9a-f]{2}")
_HEX8 = re.compile(r"[0-9a-f]{8}")  # a flat namespace's chunk file


def _shape(name: NamespaceName, manifest: Manifest | None) -> ChunkShape:
    """The shape of a namespace's chunk files: by its manifest, else (no
    manifest) by each file's header, with trailers unless format 1."""
    if manifest is not None:
        return ChunkShape(manifest.blocks_per_chunk, manifest.entry_bytes)
    return ChunkShape(legacy=name.legacy)


def _read_at(fd: int) -> Callable[[int, int], bytes]:
    return lambda offset, count: os.pread(fd, count, offset)


@dataclass(slots=True)
class ChunkFile:
    path: str
    namespace: str
    mtime: float  # its last use
    disk_bytes: int
    size: int
    ino: int


@dataclass(slots=True)
class Leftover:
    """The cache's own and no chunk: a temporary file (vineyard's or a
    manifest's) or an empty placeholder; removable once old."""

    path: str
    namespace: str
    kind: str  # "temp" or "placeholder"
    mtime: float
    disk_bytes: int
    ino: int


@dataclass(slots=True)
class Foreign:
    """An entry that is not the cache's own (never deleted)."""

    path: str
    kind: str  # "file", "directory", "symlink" or "other"
    reason: str
    namespace: str | None = None
    #: A file where a chunk belongs that is not chunk-shaped (a truncated
    #: chunk, most likely): ``verify`` checks it and may remove it.
    at_chunk_path: bool = False


@dataclass(slots=True)
class DirRecord:
    """A directory of the cache's (below the root), with its mtime and
    entry count before the scan."""

    path: str
    mtime: float
    entries: int


@dataclass
class NamespaceScan:
    name: str
    path: str
    parsed: NamespaceName
    manifest: Manifest | None
    manifest_file: str | None = None  # a regular file named layout.json
    chunks: int = 0
    bytes: int = 0  # of its chunks, on disk
    last_use: float | None = None  # the newest chunk mtime
    leftovers: int = 0


@dataclass
class RootScan:
    root: str
    namespaces: dict[str, NamespaceScan] = field(default_factory=dict)
    chunks: list[ChunkFile] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)
    foreign: list[Foreign] = field(default_factory=list)
    #: Children before parents. Without ``all_dirs`` only those that hold
    #: nothing but leftovers and such directories (the ones that may be
    #: empty once leftovers go).
    dirs: list[DirRecord] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # path, why


@dataclass
class _Frame:
    """A directory being scanned (held open: at most one per level)."""

    fd: int
    path: str
    mtime: float
    zone: str  # "ns" (the namespace directory), "chunks" or "temp"
    level: int  # chunk directories: 1 (aa) to 3 (cc)
    ns: NamespaceScan
    shape: ChunkShape
    entries: int = 0
    keep: int = 0  # entries that stay (not leftovers, not emptiable dirs)
    subdirs: list[tuple[str, os.stat_result, str, int]] = field(default_factory=list)


class _Scanner:
    def __init__(self, root: str, all_dirs: bool):
        self.scan = RootScan(root)
        self.all_dirs = all_dirs
        self.dev = 0

    def run(self) -> RootScan:
        scan = self.scan
        try:
            root_fd = os.open(scan.root, OPEN_ROOT)
        except OSError as e:
            scan.errors.append((scan.root, str(e)))
            return scan
        try:
            self.dev = os.fstat(root_fd).st_dev
            for name, st in self._list(root_fd, scan.root) or []:
                path = os.path.join(scan.root, name)
                parsed = parse_namespace_name(name)
                if stat.S_ISREG(st.st_mode) and is_root_file(name):
                    continue  # the cache's own, and no chunk
                if stat.S_ISDIR(st.st_mode) and parsed is not None:
                    if st.st_dev != self.dev:
                        self._foreign(path, st, "another filesystem mounted here")
                    else:
                        self._namespace(root_fd, name, st, parsed)
                elif stat.S_ISDIR(st.st_mode):
                    self._foreign(path, st, "a directory that is no cache namespace")
                else:
                    self._foreign(path, st, "outside the cache's namespaces")
        finally:
            os.close(root_fd)
        return scan

    def _list(self, fd: int, path: str) -> list[tuple[str, os.stat_result]] | None:
        """The entries of an open directory with their ``lstat``; entries
        that vanish meanwhile are left out; ``None`` if unreadable."""
        try:
            with os.scandir(fd) as it:
                entries = list(it)
        except OSError as e:
            self.scan.errors.append((path, str(e)))
            return None
        listed = []
        for entry in entries:
            try:
                listed.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
            except OSError as e:
                self.scan.errors.append((os.path.join(path, entry.name), str(e)))
        return listed

    def _foreign(
        self,
        path: str,
        st: os.stat_result,
        reason: str,
        ns: str | None = None,
        at_chunk_path: bool = False,
    ) -> None:
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            kind, reason = "symlink", "a symbolic link (never followed)"
        elif stat.S_ISDIR(mode):
            kind = "directory"
        elif stat.S_ISREG(mode):
            kind = "file"
        else:
            kind, reason = "other", "not a regular file, directory or link"
        self.scan.foreign.append(Foreign(path, kind, reason, ns, at_chunk_path))

    def _open(
        self, parent_fd: int, name: str, st: os.stat_result
    ) -> tuple[int, os.stat_result] | None:
        """Open a listed directory relative to its parent, without following
        a link, if it is still the one listed."""
        try:
            fd = os.open(name, OPEN_DIR, dir_fd=parent_fd)
        except OSError:
            return None
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            return None
        return fd, fst

    def _namespace(
        self, root_fd: int, name: str, st: os.stat_result, parsed: NamespaceName
    ) -> None:
        opened = self._open(root_fd, name, st)
        if opened is None:
            return
        path = os.path.join(self.scan.root, name)
        manifest = load_manifest(path, opened[0])
        ns = NamespaceScan(name, path, parsed, manifest)
        self.scan.namespaces[name] = ns
        frame = _Frame(
            opened[0], path, st.st_mtime, "ns", 0, ns, _shape(parsed, manifest)
        )
        stack = [frame]
        try:
            self._fill(frame)
            # Iterative, depth first: at most one open directory per level.
            while stack:
                top = stack[-1]
                if top.subdirs:
                    sub, sub_st, zone, level = top.subdirs.pop()
                    opened = self._open(top.fd, sub, sub_st)
                    if opened is None:
                        top.keep += 1  # gone or replaced: leave it be
                        continue
                    child = _Frame(
                        opened[0],
                        os.path.join(top.path, sub),
                        sub_st.st_mtime,
                        zone,
                        level,
                        ns,
                        top.shape,
                    )
                    stack.append(child)
                    self._fill(child)
                    continue
                stack.pop()
                os.close(top.fd)
                emptiable = top.keep == 0
                if emptiable or self.all_dirs:
                    self.scan.dirs.append(DirRecord(top.path, top.mtime, top.entries))
                if stack and not emptiable:
                    stack[-1].keep += 1
        finally:
            for f in stack:
                os.close(f.fd)

    def _fill(self, frame: _Frame) -> None:
        """Sort a directory's entries: chunks, leftovers, subdirectories to
        scan, and what is not the cache's."""
        listed = self._list(frame.fd, frame.path)
        if listed is None:
            frame.entries = frame.keep = 1  # unreadable: never emptied
            return
        frame.entries = len(listed)
        for name, st in listed:
            if not self._sort(frame, name, st):
                frame.keep += 1

    def _sort(self, frame: _Frame, name: str, st: os.stat_result) -> bool:
        """Sort one entry; whether it may go (a leftover, or a directory to
        scan that may turn out emptiable)."""
        ns, zone, mode = frame.ns, frame.zone, st.st_mode
        path = os.path.join(frame.path, name)
        if stat.S_ISDIR(mode) and st.st_dev != self.dev:
            self._foreign(path, st, "another filesystem mounted here", ns.name)
        elif stat.S_ISDIR(mode) and (
            zone == "temp" or (zone == "ns" and name == TEMP_DIR)
        ):
            frame.subdirs.append((name, st, "temp", 0))
            return True
        elif stat.S_ISDIR(mode) and zone != "temp" and _HEX2.fullmatch(name):
            if frame.level < 3:
                frame.subdirs.append((name, st, "chunks", frame.level + 1))
                return True
            self._foreign(path, st, "a directory where a chunk file belongs", ns.name)
        elif not stat.S_ISREG(mode):
            self._foreign(path, st, "not a name the cache uses here", ns.name)
        elif zone == "temp" or (zone == "ns" and is_manifest_temp(name)):
            self._leftover(path, ns, "temp", st)
            return True
        elif zone == "ns" and name == MANIFEST:
            ns.manifest_file = path
        elif (zone == "chunks" and frame.level == 3 and _HEX2.fullmatch(name)) or (
            zone == "ns" and _HEX8.fullmatch(name)
        ):
            if st.st_size == 0:  # vineyard's placeholder before a rename
                self._leftover(path, ns, "placeholder", st)
                return True
            self._chunk(frame, name, path, st)
        else:
            self._foreign(path, st, "not a name the cache uses here", ns.name)
        return False

    def _leftover(
        self, path: str, ns: NamespaceScan, kind: str, st: os.stat_result
    ) -> None:
        ns.leftovers += 1
        self.scan.leftovers.append(
            Leftover(path, ns.name, kind, st.st_mtime, disk_bytes(st), st.st_ino)
        )

    def _chunk(self, frame: _Frame, name: str, path: str, st: os.stat_result) -> None:
        ns = frame.ns
        if frame.shape.entry_bytes is not None:
            why = frame.shape.mismatch(st.st_size, None)  # by its size alone
        else:
            why = self._read_shape(frame, name, st)
        if why is not None:
            self._foreign(path, st, f"not chunk-shaped: {why}", ns.name, True)
            return
        size = disk_bytes(st)
        self.scan.chunks.append(
            ChunkFile(path, ns.name, st.st_mtime, size, st.st_size, st.st_ino)
        )
        ns.chunks += 1
        ns.bytes += size
        if ns.last_use is None or st.st_mtime > ns.last_use:
            ns.last_use = st.st_mtime

    @staticmethod
    def _read_shape(frame: _Frame, name: str, st: os.stat_result) -> str | None:
        try:
            fd = os.open(name, OPEN_FILE, dir_fd=frame.fd)
        except OSError as e:
            return f"unreadable ({e.strerror})"
        try:
            if os.fstat(fd).st_ino != st.st_ino:
                return "replaced while scanned"
            return frame.shape.mismatch(st.st_size, _read_at(fd))
        except OSError as e:
            return f"unreadable ({e.strerror})"
        finally:
            os.close(fd)


def scan_root(root: str, all_dirs: bool = False) -> RootScan:
    """One pass over a cache root: one ``lstat`` per entry (and, in a
    namespace without a manifest, a read of each chunk file's header and
    tail). Does not descend into what is not the cache's."""
    return _Scanner(root, all_dirs).run()
