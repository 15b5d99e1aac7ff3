# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark scripts in ``benchmarks/vineyard/``, run at ``--tiny`` as a
user runs them (a subprocess each): they must finish, write complete JSON
with sane figures, and keep the properties the benchmark reports on
(lookups read no KV, loads are bit-exact, every configuration of the engine
script generates the same tokens, cached probes are really loaded).

At this size the figures are noise (an engine round lasts a fraction of a
second), so no speed is asserted: the targets are judged by the full run,
whose results are in the docs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.script_testing import ROOT, clean_env, mount_slow_fs

pytestmark = pytest.mark.engine

SCRIPTS = ROOT / "benchmarks" / "vineyard"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_script(name: str, *args: str, timeout_s: float = 300.0) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=clean_env(),
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("core") / "core.json"
    stdout = run_script("benchmark_core.py", "--tiny", "--json", str(out))
    assert "readv/read" in stdout and "targets:" in stdout
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    work = tmp_path_factory.mktemp("engine")
    out, png = work / "engine.json", work / "engine.png"
    stdout = run_script(
        "benchmark_engine.py",
        "--tiny",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--workdir",
        str(work),
        "--model-dir",
        str(work / "models"),
        timeout_s=600.0,
    )
    assert "TTFT" in stdout and "no-hit throughput" in stdout
    return json.loads(out.read_text()), png


def test_core_figures_are_complete(core: dict[str, Any]) -> None:
    """Every GB/s and time is there and positive, both caches (checksum and
    keyed) loaded back exactly what was saved."""
    (r,) = core["repeats"]
    for name in ("checksum", "keyed"):
        assert r[name]["write_gbps"] > 0 and r[name]["read_gbps"] > 0
        assert r[name]["bit_exact"], f"{name}: loaded KV differs from saved"
        # The load's phases were timed, and none outlasts the whole load.
        phases = r[name]["phases_ms"]
        assert phases["read"] > 0 and phases["verify"] > 0 and phases["copy"] > 0
        assert max(phases["read"], phases["copy"]) <= phases["load"], phases
        assert 0 < r[name]["read_verify_vs_readv"] < r[name]["read_alone_vs_readv"]
    # One reader and two, on one core and on every core, each load
    # bit-exact (else the script fails).
    assert sorted(r["readers"]) == sorted(
        f"{name}/{cores}/{n}"
        for name in ("checksum", "keyed")
        for cores in ("one", "every")
        for n in (1, 2)
    )
    assert all(ms > 0 for ms in r["readers"].values())
    assert r["writev_gbps"] > 0 and r["readv_gbps"] > 0
    assert r["save"]["save_ms"] > 0 and r["save"]["memcpy_ms"] > 0
    run = r["save_run"]
    assert run["copied"] + run["skipped"] == run["saves"] and run["copied"] > 0
    assert 0 < run["p50_ms"] <= run["p99_ms"] <= run["max_ms"]
    summary = core["summary"]
    for key in ("write_gbps", "read_gbps", "read_keyed_gbps", "readv_vs_read",
                "save_vs_memcpy"):  # fmt: skip
        assert summary[key] > 0, key
    assert set(summary["targets"]) == {
        "read_within_1.3x_of_readv",
        "save_within_1.2x_of_memcpy",
        "save_p99_within_1.2x_of_memcpy",
        "lookups_read_no_kv",
    }


def test_core_lookups_read_no_kv(core: dict[str, Any]) -> None:
    """The lookups of a fully cached prompt find all of it, a miss finds
    nothing, and neither reads KV: the cache's ``bytes_read`` counter does
    not move and the process reads less than one KV block meanwhile (a
    lookup that read KV would read whole chunks)."""
    (r,) = core["repeats"]
    size, lookup = core["size"], r["lookup"]
    assert lookup["hit_tokens"] == size["num_tokens"]
    assert lookup["miss_tokens"] == 0
    assert lookup["bytes_read_delta"] == 0
    block_bytes = (
        size["num_layers"] * 2 * size["num_kv_heads"] * size["head_size"] * 2
    ) * size["block_size"]
    assert 0 <= lookup["process_read_bytes"] < block_bytes
    assert lookup["hit_us"] > 0 and lookup["miss_us"] > 0
    assert core["summary"]["targets"]["lookups_read_no_kv"]


def test_chunk_sweep_trades_files_for_round_trips(tmp_path: Path) -> None:
    """The chunk-size sweep loads every size back exactly and finds the
    whole prompt, and on the slow root (a round trip per ``stat``, ``open``,
    first ``read`` and ``fsync``) four times fewer files make the write
    faster, while a lookup's ``stat`` calls, at once, cost about the same
    at either size and less than one at a time: the round trips, not the
    bytes, bound them there."""
    out = tmp_path / "chunks.json"
    stdout = run_script(
        "benchmark_chunk_size.py", "16,64", "--tiny", "--tokens", "128",
        "--json", str(out),
    )  # fmt: skip
    assert "Chunk sizes" in stdout
    sweep = json.loads(out.read_text())["chunk_sweep"]
    roots = ["disk"] + (["slow fs"] if isinstance(sweep["slow fs"], list) else [])
    for root in roots:
        rows = {r["chunk_tokens"]: r for r in sweep[root]}
        assert set(rows) == {16, 64}
        assert [rows[c]["files_per_prompt"] for c in (16, 64)] == [8, 2]
        for r in rows.values():
            assert r["bit_exact"] and r["lookup_hit_tokens"] == 128, (root, r)
            assert r["write_gbps"] > 0 and r["read_gbps"] > 0
    if "slow fs" in roots:
        slow = {r["chunk_tokens"]: r for r in sweep["slow fs"]}
        # 8 files against 2, each costing several 20 ms round trips.
        assert slow[64]["write_ms"] < slow[16]["write_ms"]
        # 8 stat calls one after another against the first, then 7 at once.
        assert 2 * slow[16]["lookup_ms"] < slow[16]["lookup_one_at_a_time_ms"]


def test_engine_configs_side_by_side(engine: tuple[dict[str, Any], Path]) -> None:
    """No cache, sync, async and the ExampleConnector peer all ran the same
    unique prompts and generated the same tokens; throughput is positive
    and the ratios are relative to no cache."""
    result, _ = engine
    (model,) = result["models"]
    t = model["throughput"]
    assert set(t["best_tokens_per_s"]) == {"no cache", "sync", "async", "peer"}
    assert all(v > 0 for v in t["best_tokens_per_s"].values())
    assert t["ratio_vs_no_cache"]["no cache"] == pytest.approx(1.0)
    assert t["outputs_identical"], "a configuration changed the outputs"
    for cfg in ("sync", "async"):
        # Every step of unique prompts saves: the cache did write.
        assert t["saves"][cfg]["saves"] > 0
        assert t["saves"][cfg]["tokens_written"] > 0
        # The writers' CPU time is reported with what they wrote.
        assert t["saves"][cfg]["writer_cpu_s_per_gb"] > 0


def test_engine_ttft_spread_is_loaded_to_the_block(
    engine: tuple[dict[str, Any], Path],
) -> None:
    """On the fresh engines every probe of the spread, whatever its length,
    loaded all its complete blocks before the token vLLM must compute (the
    vineyard cache counted them), the lookups read metadata only, and the
    first generated token equals the recomputing engine's."""
    result, png = engine
    (model,) = result["models"]
    f = model["ttft"]
    block = f["block_size"]
    lengths = [row["tokens"] for row in f["rows"]]
    assert set(result["plan"]["ttft_lengths"]) <= set(lengths)
    assert any(n % block for n in lengths)  # lengths not chosen to fit
    assert f["readv_gbps"] > 0 and f["one_block_forward_s"] > 0
    for row in f["rows"]:
        n = row["tokens"]
        assert row["recompute_s"] > 0
        vineyard = row["async"]
        assert vineyard["loaded"] == (n - 1) // block * block, n
        assert vineyard["recomputed"] <= block + 1
        assert vineyard["floor_s"] > 0 and vineyard["cached_s"] > 0
    c = f["configs"]["async"]
    assert c["outputs_match_recompute"]
    assert f["configs"]["peer"]["outputs_match_recompute"]
    assert c["loaded_tokens"] >= sum(row["async"]["loaded"] for row in f["rows"])
    assert c["reader_cpu_s_per_gb"] > 0
    # At most one stat per block a lookup may hit (the cold one-block
    # prompt, the warm-up probe of the first length, the spread).
    looked_up = [block, lengths[0], *lengths]
    assert 0 < c["lookup_stats"] <= sum((n - 1) // block for n in looked_up)
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_engine_hit_breakdown_adds_up_to_the_ttft(
    engine: tuple[dict[str, Any], Path],
) -> None:
    """Each cached probe's hit is timed once in every phase, the reader's
    read and verify and the forward thread's copy fit inside its load (or,
    loaded before its forward pass, inside that phase), and
    the phases account for its measured TTFT: all of it but the front end's
    work before and after (within 10% for the typical probe; a preemption
    in the front end can cost a single probe more at this size)."""
    (model,) = engine[0]["models"]
    shares = []
    for row in model["ttft"]["rows"]:
        b = row["async"]["breakdown"]
        phases = b["phases_s"]
        assert set(b["counts"].values()) == {1}, (row["tokens"], b["counts"])
        assert all(seconds >= 0 for seconds in phases.values()), phases
        # One reader reads and verifies in turn, while the forward thread
        # copies the previous segment: each fits in the load.
        load_s = phases["hit_forward_s" if b["sync"] else "hit_load_s"] + 1e-3
        assert phases["load_read_s"] + phases["load_verify_s"] <= load_s, b
        assert phases["load_copy_s"] <= load_s, b
        assert phases["hit_forward_s"] > 0 and phases["load_read_s"] > 0
        assert b["accounted_s"] <= b["ttft_s"] * 1.02, b
        shares.append(b["accounted_share"])
    shares.sort()
    assert shares[len(shares) // 2] >= 0.9, shares
    assert shares[0] >= 0.7, shares


@pytest.mark.parametrize(("latency_ms", "io_latency_ms"), [(0, 0), (60, 0), (0, 60)])
def test_slow_fs_adds_latency_where_a_remote_filesystem_has_it(
    tmp_path: Path, latency_ms: float, io_latency_ms: float
) -> None:
    """The serving benchmark's slow root (``slow_fs.py``) delays what it
    says: each ``stat`` and ``open`` by ``latency_ms``; the first ``read``
    of an open file (not the next ones) and each ``fsync`` by
    ``io_latency_ms``."""

    def took_ms(op: Any, *args: Any) -> float:
        start = time.perf_counter()
        op(*args)
        return 1e3 * (time.perf_counter() - start)

    fs = mount_slow_fs(tmp_path / "fs", latency_ms, io_latency_ms)
    try:
        path = fs.mount / "chunk"
        path.write_bytes(os.urandom(1 << 20))
        metadata = [
            took_ms(os.stat, path),
            took_ms(lambda: os.close(os.open(path, os.O_RDONLY))),
        ]
        fd = os.open(path, os.O_RDWR)
        try:
            first_ms = took_ms(os.pread, fd, 4096, 0)
            next_ms = took_ms(os.pread, fd, 4096, 1 << 19)
            fsync_ms = took_ms(os.fsync, fd)
        finally:
            os.close(fd)
        # A hard link, as the cache makes to put its root settings in place
        # without replacing another instance's.
        os.link(path, fs.mount / "linked")
        assert (fs.mount / "linked").read_bytes() == path.read_bytes()
    finally:
        fs.close()
    fast_ms = 50.0  # an unloaded local call is well under this
    if latency_ms:
        assert min(metadata) >= latency_ms, metadata
    else:
        assert max(metadata) < fast_ms, metadata
    if io_latency_ms:
        assert min(first_ms, fsync_ms) >= io_latency_ms, (first_ms, fsync_ms)
        assert next_ms < io_latency_ms, next_ms
    elif not latency_ms:  # (with it, the kernel's getattr before a read waits)
        assert max(first_ms, next_ms, fsync_ms) < fast_ms


def test_a_daemon_on_the_instances_cores_gets_a_kernel_clients_priority() -> None:
    """Where no core is free for a filesystem's daemon, the chats benchmark
    gives every thread of it ``DAEMON_NICE`` (a kernel client's work runs
    ahead of user processes), or says that it could not (not root)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "vineyard"))
    import serve_harness

    two_threads = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"  # noqa: E501
    daemon = subprocess.Popen([sys.executable, "-c", two_threads])
    try:
        tasks = Path(f"/proc/{daemon.pid}/task")
        deadline = time.monotonic() + 30
        while len(list(tasks.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        set_to = serve_harness.favour([daemon.pid])
        nices = {
            os.getpriority(os.PRIO_PROCESS, int(tid.name)) for tid in tasks.iterdir()
        }
    finally:
        daemon.kill()
        daemon.wait()
    if os.geteuid() == 0:
        assert set_to == serve_harness.DAEMON_NICE < 0
        assert nices == {serve_harness.DAEMON_NICE}
    else:
        assert set_to is None
        assert nices == {os.getpriority(os.PRIO_PROCESS, 0)}
