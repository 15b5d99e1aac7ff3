# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The operator's tool (``vineyard-llm-cache``) and the root's format it
shares with the sweeper, on roots that real caches (real vineyard, real
backend processes) wrote: ``ls``, ``verify`` (damage made at rest),
``purge``, ``evict``, usage errors, and the installed console script.

Commands run in-process through ``main([...])`` (output by ``capsys``),
and once each as the installed script, ``python -m`` and by path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import (
    CHUNK_SIZE,
    CacheFactory,
    CacheHarness,
    chunk_files,
    make_tokens,
    read_header_ids,
)
from vllm.worker.vineyard import launch
from vllm.worker.vineyard.cli import main
from vllm.worker.vineyard.cli import settings as vineyard_cli
from vllm.worker.vineyard.cli.arguments import parse_size
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.storage.digests import FORMAT_VERSION
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.namespaces import (
    MANIFEST,
    is_namespace_name,
    load_manifest,
    parse_namespace_name,
    write_manifest,
)
from vllm.worker.vineyard.storage.scan import scan_root
from vllm.worker.vineyard.storage.sweeper import RootSweeper

SEQ_CHUNKS = 4
SEQ_LEN = SEQ_CHUNKS * CHUNK_SIZE + 3


def with_manifest(h: CacheHarness) -> CacheHarness:
    """The cache's namespace with its manifest (written here if the cache
    did not write it itself)."""
    if not os.path.exists(os.path.join(h.namespace_dir, MANIFEST)):
        assert write_manifest(h.namespace_dir, h.layout)
    return h


def fill(h: CacheHarness, prompts: int) -> list[list[int]]:
    """Save ``prompts`` prompts of :data:`SEQ_CHUNKS` whole chunks each."""
    saved = []
    for i in range(prompts):
        tokens = make_tokens(SEQ_LEN)
        h.save_tokens(tokens, 0, f"fill-{i}")
        saved.append(tokens)
    return saved


def run(
    capsys: pytest.CaptureFixture[str], *argv: str | os.PathLike[str]
) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(
    capsys: pytest.CaptureFixture[str], *argv: str | os.PathLike[str]
) -> tuple[int, Any]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)  # one document, nothing else on stdout


def plant_foreign(root: Path) -> list[Path]:
    """What an operator or another program may leave on a cache root."""
    notes = root / "notes.txt"
    notes.write_text("not the cache's\n")
    deep = root / "other" / "dir" / "file"
    deep.parent.mkdir(parents=True)
    deep.write_text("neither\n")
    link = root / "link"
    link.symlink_to(notes)
    return [notes, deep, link]


def read_manifest(namespace_dir: str) -> KVCacheLayout | None:
    """The layout a namespace's manifest names, or ``None`` (no manifest,
    or one that does not name this namespace)."""
    manifest = load_manifest(namespace_dir)
    if manifest is None:
        return None
    try:
        layout = KVCacheLayout(
            **{
                f.name: manifest.layout[f.name]
                for f in dataclasses.fields(KVCacheLayout)
                if f.name in manifest.layout
            }
        )
    except (TypeError, ValueError):
        return None
    return layout if layout.namespace == manifest.namespace else None


def is_chunk_file(path: str) -> bool:
    """Whether ``path`` is one of the cache's chunk files, as a scan of its
    root tells them: at ``root/namespace/aabbccdd`` (or, in a namespace of
    nested folders, ``root/namespace/aa/bb/cc/dd``), a regular file (not a
    link) shaped as its namespace's manifest says, or without one as its own
    header says."""
    parts = os.path.normpath(path).split(os.sep)
    for depth in (2, 5):  # flat, nested
        if len(parts) > depth and parse_namespace_name(parts[-depth]) is not None:
            root = os.sep.join(parts[:-depth]) or os.sep
            return os.path.normpath(path) in scanned_chunks(root)
    return False


def scanned_chunks(root: str) -> set[str]:
    return {os.path.normpath(c.path) for c in scan_root(root).chunks}


def chunks_of(namespace_dir: str) -> list[str]:
    """The chunk files of a namespace (its manifest left out)."""
    found = scanned_chunks(os.path.dirname(os.path.normpath(namespace_dir)))
    return [p for p in chunk_files(namespace_dir) if os.path.normpath(p) in found]


def disk_total(root: str | Path) -> int:
    return sum(c.disk_bytes for c in scan_root(str(root)).chunks)


# --------------------------------------------------------------------------
# The root's format
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "is_namespace"),
    [
        ("v2-test-model-0123456789abcdef-c32-tp1r0-nokey", True),
        ("v2-Llama-3.1-8B-0123456789abcdef-c256-tp4r3-a1b2c3d4e5f6", True),
        ("v2--0123456789abcdef-c32-tp1r0-nokey", True),  # no model name
        ("test-model-0123456789abcdef-tp1r0", True),  # format 1
        ("v2-test-0123456789abcdef-c32-tp1r0-nokey.bak", False),
        ("v2-test-0123456789ABCDEF-c32-tp1r0-nokey", False),
        ("v2-test-0123456789abcdef-c32-tp1r0-key", False),
        ("__temp", False),
        ("ab", False),
        ("notes.txt", False),
    ],
)
def test_namespace_names(name: str, is_namespace: bool) -> None:
    assert is_namespace_name(name) == is_namespace


def test_manifest_round_trip(small_cache: CacheHarness, tmp_path: Path) -> None:
    """The manifest names the layout (read back equal), is written once
    (a second write of the same layout keeps it), is ignored when copied
    to another namespace, and a write that cannot happen only warns."""
    h = small_cache
    ns = tmp_path / h.layout.namespace
    assert write_manifest(str(ns), h.layout)
    assert read_manifest(str(ns)) == h.layout
    manifest = load_manifest(str(ns))
    assert manifest is not None
    assert manifest.entry_bytes == h.layout.entry_bytes
    assert manifest.blocks_per_chunk == h.layout.blocks_per_chunk
    doc = json.loads((ns / MANIFEST).read_text())
    assert doc["format_version"] == FORMAT_VERSION
    assert doc["layout"]["model"] == "test-model"
    mtime = os.stat(ns / MANIFEST).st_mtime_ns
    # Until the filesystem's clock has moved past it, a rewrite would keep
    # the mtime too.
    probe = tmp_path / "probe"

    def clock_moved() -> bool:
        probe.touch()
        return os.stat(probe).st_mtime_ns > mtime

    assert wait_until(clock_moved, 10.0)
    probe.unlink()
    assert write_manifest(str(ns), h.layout)
    assert os.stat(ns / MANIFEST).st_mtime_ns == mtime  # idempotent
    assert sorted(os.listdir(ns)) == [MANIFEST]  # no temp file left
    other = tmp_path / "v2-other-0123456789abcdef-c32-tp1r0-nokey"
    other.mkdir()
    shutil.copy(ns / MANIFEST, other / MANIFEST)
    assert load_manifest(str(other)) is None and read_manifest(str(other)) is None
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert not write_manifest(str(a_file / h.layout.namespace), h.layout)


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_chunk_files_are_told_from_others(
    make_cache: CacheFactory, manifest: bool
) -> None:
    """Real chunk files are the cache's, by their size (manifest) or their
    header and trailer (none); a truncated one, a link to one, or a file of
    the same size elsewhere is not."""
    h = make_cache()
    if manifest:
        with_manifest(h)
    (tokens,) = fill(h, 1)
    paths = [h.chunk_path(tokens, c) for c in range(SEQ_CHUNKS)]
    assert all(is_chunk_file(p) for p in paths)
    header = 4 + 4 * len(read_header_ids(paths[1]))
    # Cut inside an entry (a cut between entries looks whole without a
    # manifest: then only ``verify`` tells).
    os.truncate(paths[1], header + h.layout.entry_bytes * 3 // 2)
    assert not is_chunk_file(paths[1])
    link = Path(paths[2]).with_name("ff")
    link.symlink_to(paths[2])
    assert not is_chunk_file(str(link))
    elsewhere = Path(h.config.root) / "aa" / "bb" / "cc" / "dd"
    elsewhere.parent.mkdir(parents=True)
    shutil.copy(paths[3], elsewhere)
    assert not is_chunk_file(str(elsewhere))
    scan = scan_root(h.config.root)
    assert sorted(c.path for c in scan.chunks) == sorted([paths[0], *paths[2:]])
    kinds = {f.path: (f.kind, f.at_chunk_path) for f in scan.foreign}
    assert kinds == {
        paths[1]: ("file", True),
        str(link): ("symlink", False),
        str(Path(h.config.root) / "aa"): ("directory", False),
    }


# --------------------------------------------------------------------------
# ls
# --------------------------------------------------------------------------


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_ls_names_the_namespace_and_counts_its_chunks(
    make_cache: CacheFactory, capsys: pytest.CaptureFixture[str], manifest: bool
) -> None:
    h = make_cache()
    if manifest:
        with_manifest(h)
    else:
        Path(h.namespace_dir, MANIFEST).unlink(missing_ok=True)
    fill(h, 2)
    root = Path(h.config.root)
    plant_foreign(root)
    name = os.path.basename(h.namespace_dir)

    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    line = next(line for line in out.splitlines() if name in line)
    assert "test-model" in line and " 8 " in line
    if manifest:
        assert "float32" in line and " 16 " in line and " 32 " in line
    else:
        assert "unknown (no manifest)" in line
    for path in (root / "notes.txt", root / "other", root / "link"):
        assert f"{path}  [" in out
    assert str(root / "other" / "dir") not in out  # not descended into

    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    (ns,) = doc["namespaces"]
    assert ns["namespace"] == name and ns["model"] == "test-model"
    assert ns["chunks"] == doc["total_chunks"] == 2 * SEQ_CHUNKS
    assert ns["bytes"] == sum(
        os.stat(p).st_blocks * 512 for p in chunks_of(h.namespace_dir)
    )
    assert (ns["chunk_size"], ns["tp_size"], ns["tp_rank"]) == (CHUNK_SIZE, 1, 0)
    assert ns["key_id"] == "nokey"
    assert ns["manifest"] == manifest
    if manifest:
        assert ns["format_version"] == FORMAT_VERSION
        assert (ns["dtype"], ns["block_size"]) == ("float32", 16)
        assert ns["layout"]["num_layers"] == h.layout.num_layers
    else:
        assert ns["format_version"] is None and ns["dtype"] is None
    assert abs(ns["last_use"] - time.time()) < 600
    kinds = {d["path"]: d["kind"] for d in doc["not_cache"]}
    assert kinds == {
        str(root / "notes.txt"): "file",
        str(root / "other"): "directory",
        str(root / "link"): "symlink",
    }


# --------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_verify_finds_removes_and_then_passes(
    make_cache: CacheFactory, capsys: pytest.CaptureFixture[str], manifest: bool
) -> None:
    """A flipped byte in an entry and a truncated file are bad (exit 1,
    with their reasons); ``--remove`` deletes them (still exit 1), and then
    every chunk left verifies (exit 0). Nothing else is touched."""
    h = make_cache()
    if manifest:
        with_manifest(h)
    first, second = fill(h, 2)
    root = Path(h.config.root)
    foreign = plant_foreign(root)
    entry = h.layout.entry_bytes
    flipped = h.chunk_path(first, 2)
    header = 4 + 4 * len(read_header_ids(flipped))
    flip_byte(flipped, header + entry + entry // 3)  # the 2nd entry's payload
    truncated = h.chunk_path(second, 1)
    header = 4 + 4 * len(read_header_ids(truncated))
    os.truncate(truncated, header + entry + entry // 2)

    code, out, _ = run(capsys, "verify", root)
    assert code == 1
    assert f"BAD {flipped}: entry 1: checksum does not match" in out
    assert f"BAD {truncated}:" in out and "truncated" in out
    assert "6 good, 2 bad (0 removed)" in out

    code, doc = run_json(capsys, "verify", root, "--rate-mb-s", "1000")
    assert code == 1
    assert doc["checked"] == 2 * SEQ_CHUNKS and doc["good"] == 6
    reasons = {b["path"]: b["reason"] for b in doc["bad"]}
    assert set(reasons) == {flipped, truncated}
    assert "checksum" in reasons[flipped] and "truncated" in reasons[truncated]
    assert not any(b["removed"] for b in doc["bad"])
    assert os.path.exists(flipped) and os.path.exists(truncated)

    code, doc = run_json(capsys, "verify", root, "--remove")
    assert code == 1  # bad chunks were found, even though removed
    assert doc["removed"] == 2
    assert not os.path.exists(flipped) and not os.path.exists(truncated)
    assert all(p.exists() or p.is_symlink() for p in foreign)

    code, doc = run_json(capsys, "verify", root)
    assert code == 0
    assert (doc["checked"], doc["good"], doc["bad"]) == (6, 6, [])
    # What is left still loads (a load verifies too).
    dst = h.blocks_for(40, SEQ_LEN)
    assert h.load(first, 0, 2 * CHUNK_SIZE, dst) == 2 * CHUNK_SIZE


def test_verify_skips_namespaces_sealed_with_another_key(
    make_cache: CacheFactory, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A keyed namespace is checked with its key, and skipped (not bad)
    without it or with another; unkeyed namespaces need no key."""
    keys = {}
    for name, secret in (("k1", "the first shared secret"), ("k2", "another secret!!")):
        keys[name] = tmp_path / f"{name}.key"
        keys[name].write_text(secret + "\n")
    keyed = with_manifest(make_cache(auth_key_file=str(keys["k1"])))
    plain = with_manifest(make_cache())
    fill(keyed, 1)
    fill(plain, 1)
    root = keyed.config.root
    keyed_ns = os.path.basename(keyed.namespace_dir)

    extras: list[list[str]] = [[], ["--key-file", str(keys["k2"])]]
    for extra in extras:
        code, doc = run_json(capsys, "verify", root, *extra)
        assert code == 0
        assert doc["checked"] == doc["good"] == SEQ_CHUNKS  # the plain ones
        (skipped,) = doc["skipped"]
        assert skipped["namespace"] == keyed_ns
        assert "sealed with another key" in skipped["reason"]
    code, out, _ = run(capsys, "verify", root)
    assert f"SKIPPED {keyed_ns}: sealed with another key" in out

    code, doc = run_json(capsys, "verify", root, "--key-file", keys["k1"])
    assert code == 0
    assert doc["checked"] == doc["good"] == 2 * SEQ_CHUNKS and not doc["skipped"]
    # A keyed chunk with a flipped byte fails its MAC.
    path = chunks_of(keyed.namespace_dir)[0]
    flip_byte(path, os.path.getsize(path) - 200)
    code, doc = run_json(capsys, "verify", root, "--key-file", keys["k1"])
    assert code == 1
    (bad,) = doc["bad"]
    assert bad["path"] == path and "MAC does not match" in bad["reason"]


# --------------------------------------------------------------------------
# purge and evict
# --------------------------------------------------------------------------


@pytest.mark.parametrize("by", ["--model", "--namespace"])
def test_purge_removes_that_model_only(
    make_cache: CacheFactory, capsys: pytest.CaptureFixture[str], by: str
) -> None:
    a = with_manifest(make_cache(model="org/model-a"))
    b = with_manifest(make_cache(model="model-b"))
    fill(a, 2)
    fill(b, 1)
    root = Path(a.config.root)
    foreign = plant_foreign(root)
    stray = Path(a.namespace_dir) / "README"  # someone's file inside the namespace
    stray.write_text("mine\n")
    b_chunks = sorted(chunk_files(b.namespace_dir))
    which = "org/model-a" if by == "--model" else os.path.basename(a.namespace_dir)

    code, doc = run_json(capsys, "purge", root, by, which, "--dry-run")
    assert code == 0
    (ns,) = doc["namespaces"]
    assert ns["namespace"] == os.path.basename(a.namespace_dir)
    assert ns["chunks"] == 2 * SEQ_CHUNKS and ns["left_alone"] == [str(stray)]
    assert len(chunks_of(a.namespace_dir)) == 2 * SEQ_CHUNKS  # nothing went

    code, out, _ = run(capsys, "purge", root, by, which)
    assert code == 0
    assert f"purged {os.path.basename(a.namespace_dir)} (org/model-a): 8 chunks" in out
    assert os.listdir(a.namespace_dir) == ["README"]  # all the cache's own went
    assert sorted(chunk_files(b.namespace_dir)) == b_chunks
    assert os.path.exists(os.path.join(b.namespace_dir, MANIFEST))
    assert all(p.exists() or p.is_symlink() for p in foreign)
    code, doc = run_json(capsys, "verify", root)
    assert code == 0 and doc["good"] == SEQ_CHUNKS

    # Again: nothing to do, not an error. (Its manifest went, so the
    # namespace is known by its name's base name of the model only.)
    code, doc = run_json(capsys, "purge", root, "--model", "org/model-a")
    assert code == 0 and doc["namespaces"] == []
    code, doc = run_json(capsys, "purge", root, "--model", "model-a")
    assert code == 0
    assert [(n["chunks"], n["left_alone"]) for n in doc["namespaces"]] == [
        (0, [str(stray)])
    ]


def test_purge_by_model_base_name_without_manifest(
    make_cache: CacheFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a manifest a model is known by its name in the namespace."""
    h = make_cache(model="/models/model-c")
    Path(h.namespace_dir, MANIFEST).unlink(missing_ok=True)
    fill(h, 1)
    code, doc = run_json(capsys, "purge", h.config.root, "--model", "model-c")
    assert code == 0 and doc["chunks"] == SEQ_CHUNKS
    assert chunk_files(h.config.root) == []
    assert not os.path.exists(h.namespace_dir)  # the whole namespace went


def test_evict_to_a_size_least_recently_used_first(
    make_cache: CacheFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    h = with_manifest(make_cache())
    prompts = fill(h, 3)
    root = Path(h.config.root)
    foreign = plant_foreign(root)
    now = time.time()
    for age, tokens in zip((300, 200, 100), prompts, strict=True):
        for c in range(SEQ_CHUNKS):
            os.utime(h.chunk_path(tokens, c), (now - age, now - age))
    before = disk_total(root)
    target = before // 2

    code, doc = run_json(capsys, "evict", root, "--to", str(target), "--dry-run")
    assert code == 0 and doc["bytes_after"] <= target
    assert disk_total(root) == before  # a dry run removes nothing

    size = f"{target / 1024:.3f}K"  # a size with a unit, as an operator writes it
    code, out, _ = run(capsys, "evict", root, "--to", size)
    assert code == 0 and out.startswith("evicted ")
    after = disk_total(root)
    assert after <= parse_size(size) < before
    # The oldest prompt went first (its later chunks before its first).
    assert not any(os.path.exists(h.chunk_path(prompts[0], c)) for c in range(4))
    assert all(os.path.exists(h.chunk_path(prompts[2], c)) for c in range(4))
    assert all(p.exists() or p.is_symlink() for p in foreign)
    assert os.path.exists(os.path.join(h.namespace_dir, MANIFEST))
    # Already under: nothing to do.
    code, doc = run_json(capsys, "evict", root, "--to", "10G")
    assert code == 0 and doc["evicted"] == 0 and doc["bytes_after"] == after


# --------------------------------------------------------------------------
# Usage errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["10G", "500M", "1.5T", "4096", "2k", "3 GiB"])
def test_sizes(size: str) -> None:
    want = {"10G": 10 << 30, "500M": 500 << 20, "1.5T": 3 << 39, "4096": 4096}
    want.update({"2k": 2048, "3 GiB": 3 << 30})
    assert parse_size(size) == want[size]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["ls", "{missing}"], "ROOT"),
        (["verify", "{missing}"], "ROOT"),
        (["ls", "{namespace}"], "namespace directory"),
        (["evict", "{root}", "--to", "12Q"], "--to"),
        (["evict", "{root}"], "--to"),
        (["settings", "{root}", "--disk-limit", "0"], "--disk-limit"),
        (["settings", "{root}", "--disk-limit", "lots"], "--disk-limit"),
        (["settings", "{root}", "--ttl-s", "-1"], "--ttl-s"),
        (["settings", "{root}", "--ttl-s", "2e9"], "ttl_s"),
        (["verify", "{root}", "--key-file", "{missing}"], "--key-file"),
        (["verify", "{root}", "--key-file", "{short_key}"], "--key-file"),
        (["verify", "{root}", "--rate-mb-s", "0"], "--rate-mb-s"),
        (["purge", "{root}"], "--namespace"),
        (["purge", "{root}", "--namespace", "notes"], "--namespace"),
        (["frobnicate", "{root}"], "frobnicate"),
    ],
)
def test_usage_errors_exit_2_naming_the_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], names: str
) -> None:
    root = tmp_path / "root"
    namespace = root / "v2-m-0123456789abcdef-c32-tp1r0-nokey"
    namespace.mkdir(parents=True)
    short_key = tmp_path / "short.key"
    short_key.write_text("too short")
    paths = {
        "root": root,
        "missing": tmp_path / "missing",
        "namespace": namespace,
        "short_key": short_key,
    }
    code, out, err = run(capsys, *[a.format(**paths) for a in argv])
    assert code == 2
    assert names in err
    assert out == ""


# --------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------


def test_settings_show_and_change_what_the_sweepers_follow(
    make_cache: CacheFactory, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The root's settings: none before its first sweep; the first sweeper
    records its own; the tool changes them (only what is given), `ls`
    shows them, and the next sweep evicts down to the new limit."""
    (tmp_path / "fresh").mkdir()
    code, doc = run_json(capsys, "settings", tmp_path / "fresh")
    assert code == 0 and doc["recorded"] is False
    default_limit = VineyardLLMCacheConfig().disk_limit_gb * (1 << 30)
    assert default_limit == vineyard_cli.DEFAULT_DISK_LIMIT

    h = make_cache()
    fill(h, 4)
    root = Path(h.config.root)
    sweeper = RootSweeper(str(root), 1 << 40, 0.0, 3600.0)
    sweeper.sweep()  # records its own, unless the cache's writer was first
    code, doc = run_json(capsys, "settings", root)
    assert doc["recorded"] and doc["ttl_s"] == 0.0
    assert doc["disk_limit_bytes"] in (1 << 40, default_limit)
    total = sum(os.stat(p).st_blocks * 512 for p in chunks_of(h.namespace_dir))

    code, out, _ = run(capsys, "settings", root, "--disk-limit", str(total // 2))
    assert code == 0 and "now" in out
    code, doc = run_json(capsys, "settings", root, "--ttl-s", "3600")
    assert (doc["disk_limit_bytes"], doc["ttl_s"], doc["changed"]) == (
        total // 2,
        3600.0,
        True,
    )
    code, out, _ = run(capsys, "ls", root)
    assert "root settings: disk limit" in out and "TTL 3600 s" in out

    sweeper.sweep()
    left = sum(os.stat(p).st_blocks * 512 for p in chunks_of(h.namespace_dir))
    assert 0 < left <= total // 2
    assert sweeper.ttl_s == 3600.0


# --------------------------------------------------------------------------
# Installed
# --------------------------------------------------------------------------


def console_script() -> str:
    path = shutil.which("vineyard-llm-cache", path=os.path.dirname(sys.executable))
    assert path is not None, (
        "the console script is not installed: pip install -e . "
        "(tools/setup_env.sh does)"
    )
    return path


@pytest.mark.parametrize("how", ["console-script", "module", "launcher"])
def test_runs_as_installed(make_cache: CacheFactory, tmp_path: Path, how: str) -> None:
    """``vineyard-llm-cache`` is on the venv's PATH (exit codes and all),
    and the module runs with ``-m`` and through the launcher (without vLLM)."""
    h = with_manifest(make_cache())
    fill(h, 1)
    command = {
        "console-script": [console_script()],
        "module": [sys.executable, "-m", "vllm.worker.vineyard.cli"],
        "launcher": launch.command("cli"),
    }[how]
    done = subprocess.run(
        [*command, "ls", h.config.root, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the repository: the installed package is used
    )
    assert done.returncode == 0, done.stderr
    (ns,) = json.loads(done.stdout)["namespaces"]
    assert ns["namespace"] == os.path.basename(h.namespace_dir)
    assert ns["chunks"] == SEQ_CHUNKS and ns["dtype"] == "float32"
    if how != "console-script":
        return
    done = subprocess.run(
        [*command, "evict", h.config.root, "--to", "12Q"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "--to" in done.stderr
