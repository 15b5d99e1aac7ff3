# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vineyard-llm-cache``: see, check and steer a cache root from a shell.

::

    vineyard-llm-cache ls ROOT [--json]
    vineyard-llm-cache verify ROOT [--key-file F] [--remove] [--rate-mb-s R] [--json]
    vineyard-llm-cache purge ROOT (--namespace N | --model M) [--dry-run] [--json]
    vineyard-llm-cache evict ROOT --to SIZE [--dry-run] [--json]
    vineyard-llm-cache settings ROOT [--disk-limit SIZE] [--ttl-s S] [--json]

Exit codes: 0 done (``verify``: nothing bad found), 1 ``verify`` found bad
chunks (removed or not), 2 a usage error (the message names the argument).

It works beside live instances and touches only the cache's own entries,
as :mod:`vineyard_root` tells them (the sweeper's rules); ``verify`` checks
each entry as a load does. Also runs as ``python -m
vllm.worker.vineyard.cli``, or as a script by path (which skips vLLM's
import: it needs neither vLLM nor torch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from vllm.worker.vineyard.storage import chunks, root_files, sweeper
from vllm.worker.vineyard.storage import root as root_format

PROG = "vineyard-llm-cache"
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?)(?:i?b)?\s*", re.I)
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FORMATS = {None: "unknown (no manifest)", 1: "1 (old)"}
DEFAULT_DISK_LIMIT = 100 << 30  # VINEYARD_CACHE_DISK_LIMIT_GB's default


class UsageError(Exception):
    """A bad argument: exit code 2, the message names the argument."""


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5T``, ``4096`` (bytes): binary units
    (``10G`` is 10 GiB, as ``VINEYARD_CACHE_DISK_LIMIT_GB``)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (e.g. 500M, 10G, 1.5T, or bytes)"
        )
    return int(float(m[1]) * 1024 ** _UNITS[m[2].lower()])


def _number(zero_allowed: bool) -> Callable[[str], float]:
    """An argparse type: a number > 0 (or >= 0 with ``zero_allowed``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value >= 0 if zero_allowed else value > 0):
            what = "a number >= 0" if zero_allowed else "a positive number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(ts))


def check_root(path: str) -> str:
    """The cache root to work on, or a :class:`UsageError`."""
    if not os.path.isdir(path):
        raise UsageError(f"ROOT: {path!r} is not a directory")
    name = os.path.basename(os.path.normpath(path))
    if root_format.is_namespace_name(name):
        raise UsageError(
            f"ROOT: {path!r} is a namespace directory; give the cache root "
            f"that holds it ({os.path.dirname(os.path.abspath(path))!r})"
        )
    return path


# --------------------------------------------------------------------------
# ls
# --------------------------------------------------------------------------


def _namespace_doc(ns: root_format.NamespaceScan) -> dict[str, Any]:
    """What is known of a namespace: from its manifest, else its name."""
    m, parsed = ns.manifest, ns.parsed
    layout = m.layout if m is not None else {}
    return {
        "namespace": ns.name,
        "model": layout.get("model", parsed.model),
        "dtype": layout.get("dtype"),
        "block_size": layout.get("block_size"),
        "chunk_size": layout.get("chunk_size", parsed.chunk_size),
        "tp_size": layout.get("tp_size", parsed.tp_size),
        "tp_rank": layout.get("tp_rank", parsed.tp_rank),
        "key_id": layout.get("key_id", parsed.key_id),
        "format_version": (
            m.format_version if m is not None else 1 if parsed.legacy else None
        ),
        "manifest": m is not None,
        "layout": layout or None,
        "chunks": ns.chunks,
        "bytes": ns.bytes,
        "last_use": ns.last_use,
        "last_use_iso": _iso(ns.last_use),
        "leftovers": ns.leftovers,
    }


def _foreign_doc(f: root_format.Foreign) -> dict[str, Any]:
    return {
        "path": f.path,
        "kind": f.kind,
        "reason": f.reason,
        "namespace": f.namespace,
        "at_chunk_path": f.at_chunk_path,
    }


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=True)]
        print("  ".join(cells).rstrip(), file=out)


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    root = check_root(args.root)
    scan = root_format.scan_root(root)
    namespaces = [_namespace_doc(ns) for _, ns in sorted(scan.namespaces.items())]
    settings, settings_error = _root_settings(root)
    if args.json:
        doc = {
            "root": root,
            "settings": _settings_doc(settings, settings_error),
            "namespaces": namespaces,
            "total_chunks": len(scan.chunks),
            "total_bytes": sum(c.disk_bytes for c in scan.chunks),
            "not_cache": [_foreign_doc(f) for f in scan.foreign],
            "errors": [{"path": p, "error": e} for p, e in scan.errors],
        }
        json.dump(doc, out, indent=2)
        print(file=out)
        return 0
    print(f"root settings: {_settings_text(settings, settings_error)}", file=out)
    if not namespaces:
        print(f"no cache namespaces under {root}", file=out)
    else:
        rows = [
            ["MODEL", "DTYPE", "BLOCK", "CHUNK", "TP", "KEY", "FORMAT"]
            + ["CHUNKS", "SIZE", "LAST USE", "NAMESPACE"]
        ]

        def text(value: Any) -> str:
            return "?" if value is None else str(value)

        for d in namespaces:
            rows.append(
                [
                    text(d["model"]) or "?",
                    text(d["dtype"]),
                    text(d["block_size"]),
                    text(d["chunk_size"]),
                    f"{d['tp_size']}/{d['tp_rank']}",
                    text(d["key_id"]),
                    _FORMATS.get(d["format_version"], str(d["format_version"])),
                    str(d["chunks"]),
                    human(d["bytes"]),
                    _when(d["last_use"]),
                    d["namespace"],
                ]
            )
        _table(rows, out)
        total = sum(c.disk_bytes for c in scan.chunks)
        print(
            f"total: {len(scan.chunks)} chunks, {human(total)} in "
            f"{len(namespaces)} namespace(s)",
            file=out,
        )
    if scan.foreign:
        print(
            f"\nnot the cache's own ({len(scan.foreign)}; never touched, not counted):",
            file=out,
        )
        for f in sorted(scan.foreign, key=lambda f: f.path):
            hint = " (run `verify`)" if f.at_chunk_path else ""
            print(f"  {f.path}  [{f.kind}] {f.reason}{hint}", file=out)
    if scan.errors:
        print(f"\nunreadable ({len(scan.errors)}):", file=out)
        for path, error in scan.errors:
            print(f"  {path}: {error}", file=out)
    return 0


# --------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------


class _Vanished(Exception):
    """The file went meanwhile (evicted, or repaired by a reader)."""


class RateLimit:
    """Sleeps so that reads average at most ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float | None):
        self.bytes_per_s = bytes_per_s
        self.start = time.monotonic()
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        if self.bytes_per_s:
            ahead = self.done / self.bytes_per_s - (time.monotonic() - self.start)
            if ahead > 0:
                time.sleep(ahead)


class Progress:
    """A one-line progress indicator on a terminal (nothing otherwise)."""

    def __init__(self, total: int, total_bytes: int, stream: TextIO):
        self.total, self.total_bytes, self.stream = total, total_bytes, stream
        self.enabled = stream.isatty()
        self.shown_at = 0.0

    def update(self, done: int, done_bytes: int, bad: int, last: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not last and now - self.shown_at < 0.2):
            return
        self.shown_at = now
        self.stream.write(
            f"\r\033[Kverify: {done}/{self.total} chunks, {human(done_bytes)} of "
            f"{human(self.total_bytes)}, {bad} bad" + ("\n" if last else "")
        )
        self.stream.flush()

    def clear(self) -> None:
        """Clear the line (before another line is printed)."""
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


@dataclass
class ChunkChecker:
    """Checks a namespace's chunk files entry by entry, as a load does:
    header and size, the path (vineyard's hash of the header's ids), each
    entry's trailer (its digest must be that of its id) and checksum or
    MAC. Without a manifest the entries' layout is inferred from the
    first chunk that shows it."""

    ns_dir: str
    sealer: chunks.Sealer
    geometry: tuple[int, int] | None  # blocks per chunk, entry bytes
    chunk_tokens: int | None  # from the namespace's name
    keyed: bool
    limit: RateLimit
    bytes_read: int = 0
    _buf: bytearray = field(default_factory=bytearray)

    def check(self, path: str) -> tuple[str | None, int]:
        """Why the file at ``path`` is bad (``None``: it verifies) and its
        inode; raises :class:`_Vanished` if it is gone."""
        try:
            fd = os.open(path, _OPEN_FILE)
        except FileNotFoundError:
            raise _Vanished from None
        except OSError as e:
            return f"cannot be opened ({e.strerror})", 0
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file", st.st_ino
            try:
                return self._check(fd, f, st.st_size, path), st.st_ino
            except OSError as e:
                return f"read error ({e.strerror})", st.st_ino

    def _read(self, f: Any, n: int) -> bytes:
        data = f.read(n)
        self.bytes_read += len(data)
        self.limit.add(len(data))
        return data

    def _check(self, fd: int, f: Any, size: int, path: str) -> str | None:
        head = self._read(f, 4)
        n = int.from_bytes(head, "little", signed=True) if len(head) == 4 else 0
        if n < 1 or 4 + 4 * n > size:
            return (
                f"its header (n={n}) does not fit its {size} bytes "
                "(truncated, or no chunk)"
            )
        raw = self._read(f, 4 * n)
        if len(raw) != 4 * n:
            return "short read (the file shrank)"
        ids = np.frombuffer(raw, "<i4").tolist()
        geometry = self.geometry or self._infer(fd, size, ids)
        if geometry is None:
            return (
                "no manifest, and the layout of its entries cannot be told "
                "from it (truncated or damaged)"
            )
        bpc, entry_bytes = geometry
        want = 4 + 4 * n + bpc * entry_bytes
        if size != want:
            what = "truncated" if size < want else "bytes past its end"
            return (
                f"size {size}, but {n} ids and {bpc} entries of {entry_bytes} "
                f"bytes make {want} ({what})"
            )
        if n % bpc:
            return f"its header holds {n} ids, not whole chunks of {bpc} blocks"
        if chunks.ChunkFiles(self.ns_dir, bpc, entry_bytes).path(ids) != path:
            return "its path is not the hash of its header's ids (misplaced)"
        if len(self._buf) != entry_bytes:
            self._buf = bytearray(entry_bytes)
        view = memoryview(self._buf)
        tail = entry_bytes - chunks.TRAILER_BYTES
        for i in range(bpc):
            got = f.readinto(view)
            while got is not None and 0 < got < entry_bytes:
                more = f.readinto(view[got:])
                if not more:
                    break
                got += more
            self.bytes_read += got or 0
            self.limit.add(got or 0)
            if got != entry_bytes:
                return f"entry {i}: short read (the file shrank)"
            block_id = ids[n - bpc + i]
            if bytes(view[tail : tail + len(chunks.MAGIC_PREFIX)]) != (
                chunks.MAGIC_PREFIX
            ):
                return f"entry {i}: no entry trailer (overwritten or not sealed)"
            digest = chunks.Sealer.digest_of(view)
            if chunks.synthetic_id(digest) != block_id:
                return (
                    f"entry {i}: its digest is not that of its id {block_id} "
                    "(a block of another prefix)"
                )
            if not self.sealer.verify(view, digest):
                what = "MAC" if self.keyed else "checksum"
                return f"entry {i}: {what} does not match (its bytes changed)"
        return None

    def _infer(self, fd: int, size: int, ids: list[int]) -> tuple[int, int] | None:
        """Blocks per chunk and entry bytes of a namespace without manifest:
        the largest split of the file's data into entries whose trailers
        all name their blocks. (One entry of all the data always does: its
        trailer is the last one, so smaller splits must lose.)"""
        n, data = len(ids), size - 4 - 4 * len(ids)
        for bpc in range(min(n, self.chunk_tokens or n), 0, -1):
            if n % bpc or data % bpc or (self.chunk_tokens or 0) % bpc:
                continue
            entry_bytes = data // bpc
            if entry_bytes > chunks.TRAILER_BYTES and all(
                self._names_its_block(
                    fd, 4 + 4 * n + (i + 1) * entry_bytes, ids[i - bpc]
                )
                for i in range(bpc)
            ):
                self.geometry = (bpc, entry_bytes)
                return self.geometry
        return None

    @staticmethod
    def _names_its_block(fd: int, entry_end: int, block_id: int) -> bool:
        trailer = os.pread(fd, chunks.TRAILER_BYTES, entry_end - chunks.TRAILER_BYTES)
        return trailer.startswith(chunks.MAGIC_PREFIX) and (
            chunks.synthetic_id(chunks.Sealer.digest_of(memoryview(trailer)))
            == block_id
        )


def _skip_reason(
    ns: root_format.NamespaceScan, key: bytes | None, key_file: str
) -> str | None:
    if ns.parsed.legacy:
        return "old format (1): never read by the cache; the sweeper evicts it"
    if ns.parsed.format_version != chunks.FORMAT_VERSION:
        return (
            f"format {ns.parsed.format_version}: not this version's "
            f"({chunks.FORMAT_VERSION})"
        )
    ns_key = _namespace_key(ns)
    if ns_key == "nokey" or (key is not None and chunks.key_id(key) == ns_key):
        return None
    given = (
        f"--key-file {key_file!r} is key {chunks.key_id(key)}"
        if key
        else ("no --key-file given")
    )
    return f"sealed with another key (key {ns_key}; {given})"


def _namespace_key(ns: root_format.NamespaceScan) -> str | None:
    if ns.manifest is not None:
        return str(ns.manifest.layout.get("key_id", ns.parsed.key_id))
    return ns.parsed.key_id


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    root = check_root(args.root)
    try:
        key = chunks.load_auth_key(args.key_file or "", setting="--key-file")
    except ValueError as e:
        raise UsageError(str(e)) from None
    scan = root_format.scan_root(root)
    rate = args.rate_mb_s * (1 << 20) if args.rate_mb_s else None
    limit = RateLimit(rate)
    checkers: dict[str, ChunkChecker] = {}
    skipped = []
    for name, ns in sorted(scan.namespaces.items()):
        why = _skip_reason(ns, key, args.key_file or "")
        if why is not None:
            skipped.append({"namespace": name, "reason": why, "chunks": ns.chunks})
            continue
        keyed = _namespace_key(ns) != "nokey"
        m = ns.manifest
        checkers[name] = ChunkChecker(
            ns.path,
            chunks.Sealer(key if keyed else None, name),
            (m.blocks_per_chunk, m.entry_bytes) if m is not None else None,
            ns.parsed.chunk_size,
            keyed,
            limit,
        )
    # Chunk-shaped files, and files where chunks belong that are not (a
    # truncated chunk is the likeliest).
    todo = [(c.path, c.namespace, c.size) for c in scan.chunks]
    todo += [
        (f.path, f.namespace, 0)
        for f in scan.foreign
        if f.at_chunk_path and f.namespace is not None
    ]
    todo = sorted(t for t in todo if t[1] in checkers)
    total_bytes = sum(t[2] for t in todo)
    progress = Progress(len(todo), total_bytes, sys.stderr)
    start = time.monotonic()
    bad: list[dict[str, Any]] = []
    good = vanished = 0
    for i, (path, name, _) in enumerate(todo):
        checker = checkers[name]
        try:
            reason, ino = checker.check(path)
        except _Vanished:
            vanished += 1
            continue
        if reason is None:
            good += 1
        else:
            removed = bool(args.remove) and root_format.remove_file(root, path, ino)
            bad.append(
                {"path": path, "namespace": name, "reason": reason, "removed": removed}
            )
            if not args.json:
                note = " (removed)" if removed else ""
                progress.clear()
                print(f"BAD {path}: {reason}{note}", file=out, flush=True)
        read = sum(c.bytes_read for c in checkers.values())
        progress.update(i + 1, read, len(bad))
    bytes_read = sum(c.bytes_read for c in checkers.values())
    progress.update(len(todo), bytes_read, len(bad), last=True)
    seconds = time.monotonic() - start
    num_removed = sum(b["removed"] for b in bad)
    if args.json:
        doc = {
            "root": root,
            "checked": good + len(bad),
            "good": good,
            "bad": bad,
            "removed": num_removed,
            "vanished": vanished,
            "skipped": skipped,
            "bytes_read": bytes_read,
            "seconds": round(seconds, 3),
        }
        json.dump(doc, out, indent=2)
        print(file=out)
    else:
        for s in skipped:
            print(f"SKIPPED {s['namespace']}: {s['reason']}", file=out)
        print(
            f"verified {good + len(bad)} chunks ({human(bytes_read)} read) in "
            f"{seconds:.1f} s: {good} good, {len(bad)} bad ({num_removed} removed)"
            + (f", {vanished} gone meanwhile" if vanished else "")
            + (f"; {len(skipped)} namespace(s) skipped" if skipped else ""),
            file=out,
        )
    return 1 if bad else 0


# --------------------------------------------------------------------------
# purge and evict
# --------------------------------------------------------------------------


def _model_matches(ns: root_format.NamespaceScan, model: str) -> bool:
    """``model`` as the manifest has it (the model's path or name), or as
    the namespace's name has it (its base name)."""
    if ns.manifest is not None and ns.manifest.layout.get("model") == model:
        return True
    return ns.parsed.model == model


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + os.sep)


def cmd_purge(args: argparse.Namespace, out: TextIO) -> int:
    root = check_root(args.root)
    if args.namespace is not None and not root_format.is_namespace_name(args.namespace):
        raise UsageError(
            f"--namespace: {args.namespace!r} is not a namespace name (`ls` shows them)"
        )
    scan = root_format.scan_root(root, all_dirs=True)
    if args.namespace is not None:
        targets = [ns for ns in scan.namespaces.values() if ns.name == args.namespace]
    else:
        targets = [
            ns for ns in scan.namespaces.values() if _model_matches(ns, args.model)
        ]
    results = []
    for ns in sorted(targets, key=lambda t: t.name):
        chunks = [c for c in scan.chunks if c.namespace == ns.name]
        leftovers = [x for x in scan.leftovers if x.namespace == ns.name]
        removed = freed = 0
        if not args.dry_run:
            for c in chunks:
                if root_format.remove_file(root, c.path, c.ino):
                    removed += 1
                    freed += c.disk_bytes
            for x in leftovers:
                root_format.remove_file(root, x.path, x.ino)
            if ns.manifest_file is not None:
                root_format.remove_file(root, ns.manifest_file)
            for d in scan.dirs:  # children first; fails where not empty
                if _under(d.path, ns.path):
                    root_format.remove_dir(root, d.path)
        left = [f.path for f in scan.foreign if f.namespace == ns.name]
        results.append(
            {
                "namespace": ns.name,
                "model": _namespace_doc(ns)["model"],
                "chunks": len(chunks) if args.dry_run else removed,
                "bytes": sum(c.disk_bytes for c in chunks) if args.dry_run else freed,
                "other_files": len(leftovers) + (ns.manifest_file is not None),
                "directory_removed": not args.dry_run and not os.path.lexists(ns.path),
                "left_alone": left,
            }
        )
    if args.json:
        doc = {
            "root": root,
            "dry_run": bool(args.dry_run),
            "namespaces": results,
            "chunks": sum(r["chunks"] for r in results),
            "bytes": sum(r["bytes"] for r in results),
        }
        json.dump(doc, out, indent=2)
        print(file=out)
        return 0
    if not results:
        what = (
            f"--namespace {args.namespace!r}"
            if args.namespace is not None
            else f"--model {args.model!r}"
        )
        print(f"nothing matches {what} under {root}", file=out)
    verb = "would purge" if args.dry_run else "purged"
    for r in results:
        note = ""
        if r["left_alone"]:
            note = f"; left alone (not the cache's): {', '.join(r['left_alone'])}"
        elif r["directory_removed"]:
            note = "; directory removed"
        print(
            f"{verb} {r['namespace']} ({r['model']}): {r['chunks']} chunks, "
            f"{human(r['bytes'])}, {r['other_files']} other file(s){note}",
            file=out,
        )
    return 0


def cmd_evict(args: argparse.Namespace, out: TextIO) -> int:
    root = check_root(args.root)
    scan = root_format.scan_root(root)
    chunks = scan.chunks
    before = sum(c.disk_bytes for c in chunks)

    def remove(chunk: root_format.ChunkFile) -> bool:
        return root_format.remove_file(root, chunk.path, chunk.ino)

    def pretend(chunk: root_format.ChunkFile) -> bool:
        return True

    # The sweeper's order: least recently used first.
    sweeper.distrust_future(chunks, time.time())
    done, removed, after = sweeper.evict_lru(
        chunks, before, args.to, pretend if args.dry_run else remove
    )
    gone = chunks[:done]
    by_namespace: dict[str, dict[str, int]] = {}
    for c in gone:
        entry = by_namespace.setdefault(c.namespace, {"chunks": 0, "bytes": 0})
        entry["chunks"] += 1
        entry["bytes"] += c.disk_bytes
    if args.json:
        doc = {
            "root": root,
            "dry_run": bool(args.dry_run),
            "target_bytes": args.to,
            "bytes_before": before,
            "bytes_after": after,
            "evicted": done,
            "removed": removed,
            "by_namespace": by_namespace,
            "paths": [c.path for c in gone],
        }
        json.dump(doc, out, indent=2)
        print(file=out)
        return 0
    verb = "would evict" if args.dry_run else "evicted"
    print(
        f"{verb} {done} chunks ({human(before - after)}, least recently used "
        f"first): {human(before)} -> {human(after)} (target {human(args.to)})",
        file=out,
    )
    for name, entry in sorted(by_namespace.items()):
        print(f"  {name}: {entry['chunks']} chunks, {human(entry['bytes'])}", file=out)
    return 0


# --------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------


def _root_settings(root: str) -> tuple[root_files.RootSettings | None, str | None]:
    """The root's recorded settings and, where they cannot be read, why."""
    try:
        return root_files.read_root_settings(root), None
    except (OSError, ValueError) as e:
        return None, str(e)


def _settings_doc(
    settings: root_files.RootSettings | None, error: str | None
) -> dict[str, Any]:
    return {
        "recorded": settings is not None,
        "disk_limit_bytes": settings.disk_limit_bytes if settings else None,
        "ttl_s": settings.ttl_s if settings else None,
        "error": error,
    }


def _settings_text(settings: root_files.RootSettings | None, error: str | None) -> str:
    if error is not None:
        return f"unreadable ({error}); each process sweeps with its own"
    if settings is None:
        return "none recorded yet (the first instance to sweep records its own)"
    return settings.describe()


def cmd_settings(args: argparse.Namespace, out: TextIO) -> int:
    root = check_root(args.root)
    settings, error = _root_settings(root)
    changed = args.disk_limit is not None or args.ttl_s is not None
    if changed:
        # Unset parts: as recorded, else the instances' defaults.
        base = settings or root_files.RootSettings(DEFAULT_DISK_LIMIT, 0.0)
        try:
            new = root_files.RootSettings(
                base.disk_limit_bytes if args.disk_limit is None else args.disk_limit,
                base.ttl_s if args.ttl_s is None else args.ttl_s,
            )
        except ValueError as e:
            raise UsageError(str(e).replace("disk_limit_bytes", "--disk-limit")) from e
        settings = root_files.record_root_settings(
            root, new, replace=True, group_access=_group_access(root)
        )
        error = None
    if args.json:
        json.dump(
            {"root": root, "changed": changed, **_settings_doc(settings, error)}, out
        )
        print(file=out)
        return 0
    verb = "now" if changed else "are"
    print(
        f"the settings of {root} {verb}: {_settings_text(settings, error)}; they "
        "govern every instance's sweeps of it (from their next sweep)",
        file=out,
    )
    return 0


def _group_access(root: str) -> bool:
    """Whether the root is shared by a group (as the instances set it)."""
    return bool(os.stat(root).st_mode & stat.S_IRWXG)


# --------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="See, check and steer a vineyard LLM cache root. Touches "
        "only the cache's own files; runs beside live instances.",
        epilog="Exit codes: 0 done, 1 verify found bad chunks, 2 usage error.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, help: str, run: Callable[[argparse.Namespace, TextIO], int]
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("root", metavar="ROOT", help="the cache root")
        p.add_argument(
            "--json", action="store_true", help="one JSON document on stdout"
        )
        p.set_defaults(run=run)
        return p

    command(
        "ls", "namespaces, their size and last use; what is not the cache's", cmd_ls
    )
    p = command(
        "verify",
        "read every chunk and verify every entry as a load does",
        cmd_verify,
    )
    p.add_argument(
        "--key-file",
        metavar="F",
        help="the secret of the instances' VINEYARD_CACHE_AUTH_KEY_FILE "
        "(namespaces sealed with another key are skipped)",
    )
    p.add_argument("--remove", action="store_true", help="delete bad chunks")
    p.add_argument(
        "--rate-mb-s",
        type=_number(zero_allowed=False),
        metavar="R",
        help="read at most R MiB/s (to run beside live instances)",
    )
    p = command("purge", "delete namespaces (all their chunks)", cmd_purge)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="N", help="a namespace (see `ls`)")
    which.add_argument(
        "--model",
        metavar="M",
        help="every namespace of this model (as served, or as `ls` names it)",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would go")
    p = command("evict", "evict least recently used chunks down to a size", cmd_evict)
    p.add_argument(
        "--to",
        type=parse_size,
        required=True,
        metavar="SIZE",
        help="bytes of chunks to keep at most: 500M, 10G, 1.5T (binary units)",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would go")
    p = command(
        "settings",
        "show or change the root's own disk limit and TTL, which govern every "
        "instance's sweeps of it",
        cmd_settings,
    )
    p.add_argument(
        "--disk-limit",
        type=parse_size,
        metavar="SIZE",
        help="most bytes of chunks on the root: 500M, 10G, 1.5T (binary units)",
    )
    p.add_argument(
        "--ttl-s",
        type=_number(zero_allowed=True),
        metavar="S",
        help="seconds after its last use when a chunk expires (0: never)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.run(args, sys.stdout))
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
