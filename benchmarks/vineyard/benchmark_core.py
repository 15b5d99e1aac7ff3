# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard KV cache's core, without an engine, on an 8B-class KV layout.

Measures, with the cache's real backend processes on a real vineyard root:

  (a) write and read GB/s through ``VineyardLLMCache`` (save, then wait until
      the pool is idle; load into KV blocks), next to a plain ``os.writev`` +
      ``fdatasync`` and ``os.readv`` (page cache warm) of the same bytes in
      one file per chunk: the physical reference;
  (b) the cost of verification: read GB/s with the checksum (default) and
      with a key (``auth_key_file``: keyed BLAKE3);
  (c) the forward thread's time per save next to one memcpy of the bytes:
      one step with the writer idle, and p50/p99/max over a long run of
      steps on a fresh cache (its buffers' first uses included) with the
      writer falling behind (updates skipped, counted);
  (d) scheduler lookups of a fully cached prompt: their time and the KV
      bytes they read (the ``bytes_read`` counter and this process's read
      syscalls, which must both stay at zero KV);
  (e) a load with one reader and with two (reads and verification of
      segments at once), with this process on one core and on every core.

The process is pinned to one core, like a forward pass; the cache's backends
move to the other cores. Usage::

    python benchmarks/vineyard/benchmark_core.py [--tiny] [--repeats 3] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.transfer.saves import SaveRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_harness import (  # noqa: E402
    GB,
    Bench,
    Size,
    add_size_arguments,
    median_time,
    pin_like_a_forward_pass,
    plain_files,
    size_of,
    write_then_read,
)

TARGET_READ_VS_READV = 1.3  # cache read time at most 1.3x readv's
TARGET_SAVE_VS_MEMCPY = 1.2  # forward-thread save at most 1.2x one memcpy


def measure(size: Size, workdir: str) -> dict[str, Any]:
    """One repeat of every measurement."""
    out: dict[str, Any] = {}
    os.makedirs(workdir, exist_ok=True)
    key_file = os.path.join(workdir, "auth.key")
    with open(key_file, "w") as f:
        f.write("benchmark-secret-0123456789abcdef\n")
    for name, key in (("checksum", ""), ("keyed", key_file)):
        b = Bench(size, os.path.join(workdir, f"root-{name}"), key)
        try:
            prompts, write_s, phases = write_then_read(b)
            read_s = statistics.median(p["load"] for p in phases)
            out[name] = {
                "write_gbps": b.prompt_bytes / write_s / GB,
                "read_gbps": b.prompt_bytes / read_s / GB,
                "bit_exact": b.loaded_exact(),
                # Medians of each phase (ms): what bounds the read.
                "phases_ms": {
                    k: 1e3 * statistics.median(p[k] for p in phases) for k in phases[0]
                },
            }
            if name == "checksum":
                out["bytes"] = b.prompt_bytes
                out["lookup"] = measure_lookups(b, prompts[0])
                out["save"] = measure_save(b)
                out["save_run"] = measure_save_run(
                    size, os.path.join(workdir, "root-run")
                )
                w, r = plain_files(b, os.path.join(workdir, "plain"), size.iters)
                out["writev_gbps"] = b.prompt_bytes / w / GB
                out["readv_gbps"] = b.prompt_bytes / r / GB
                out["readv_ms"] = 1e3 * r
        finally:
            b.close()
    out["readers"] = measure_readers(size, workdir, key_file)
    c = out["checksum"]
    out["write_vs_writev"] = c["write_gbps"] / out["writev_gbps"]
    out["readv_vs_read"] = out["readv_gbps"] / c["read_gbps"]
    out["mac_vs_checksum_read"] = out["keyed"]["read_gbps"] / c["read_gbps"]
    # Each phase's speed as a share of readv's: vineyard's read alone, and
    # the read with the verification after it (one reader, one core).
    for name in ("checksum", "keyed"):
        ph = out[name]["phases_ms"]
        out[name]["read_alone_vs_readv"] = out["readv_ms"] / ph["read"]
        out[name]["read_verify_vs_readv"] = out["readv_ms"] / (
            ph["read"] + ph["verify"]
        )
    return out


@contextlib.contextmanager
def _cores(every: bool) -> Iterator[None]:
    """This process (and the backends it starts) on every core, or left on
    the one it is pinned to."""
    pinned = os.sched_getaffinity(0)
    if every:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def measure_readers(size: Size, workdir: str, key_file: str) -> dict[str, Any]:
    """Median load ms of one prompt with one reader and with two, with this
    process (the forward thread, which copies) on its one core, and on
    every core (as where a core is free for the second reader), per check;
    every load bit-exact."""
    out: dict[str, Any] = {}
    for name, key in (("checksum", ""), ("keyed", key_file)):
        root = os.path.join(workdir, f"root-readers-{name}")
        writer = Bench(size, root, key)
        try:
            prompt = writer.new_prompt()
            writer.save(prompt, "w")
            for cores in ("one", "every"):
                with _cores(cores == "every"):
                    for readers in (1, 2):
                        b = Bench(size, root, key, readers=readers)
                        try:
                            b.kv[:, : b.blocks] = writer.kv[:, : writer.blocks]
                            b.load(prompt)  # warm: the page cache, the path
                            ms = [1e3 * b.load(prompt) for _ in range(size.iters)]
                            if not b.loaded_exact():
                                raise RuntimeError("a load was not bit-exact")
                            out[f"{name}/{cores}/{readers}"] = statistics.median(ms)
                        finally:
                            b.close()
        finally:
            writer.close()
    return out


def _rchar() -> int:
    """Bytes this process has read with read syscalls (/proc/self/io)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def measure_lookups(b: Bench, digests: list[bytes], n: int = 200) -> dict[str, Any]:
    """Scheduler lookups of the fully cached prompt (plus one token to
    compute) and of a miss: time, tokens found, KV bytes read."""
    lookup = VineyardCacheLookup(b.config, [b.layout])
    tokens = b.size.num_tokens
    miss = b.new_prompt()
    before = b.cache.metrics.snapshot()["bytes_read"]
    rchar = _rchar()
    own = _rchar() - rchar  # reading /proc/self/io reads bytes too
    rchar += own
    start = time.perf_counter()
    for _ in range(n):
        hit, _ = lookup.lookup(digests, 0, tokens + 1)
    hit_s = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        missed, _ = lookup.lookup(miss, 0, tokens + 1)
    miss_s = (time.perf_counter() - start) / n
    return {
        "lookups": 2 * n,
        "hit_tokens": hit,
        "miss_tokens": missed,
        "hit_us": hit_s * 1e6,
        "miss_us": miss_s * 1e6,
        "bytes_read_delta": b.cache.metrics.snapshot()["bytes_read"] - before,
        "process_read_bytes": _rchar() - rchar - own,
        "chunks": tokens // b.size.chunk_size,
    }


def measure_save(b: Bench) -> dict[str, Any]:
    """The forward thread's time in ``save`` for one step (writer idle, as
    when the pool has a free buffer) next to one memcpy of the same bytes
    (both on this process's one core)."""
    step = b.size.step_tokens
    nbytes = step // b.size.block_size * b.layout.payload_bytes
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1), dst.fill_(2)

    def memcpy() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    memcpy_s = median_time(memcpy, b.size.iters)
    blocks = list(range(step // b.size.block_size))
    times = []
    for i in range(b.size.iters):
        digests = b.new_prompt()[: len(blocks)]
        req = SaveRequest(f"s{i}", digests, step, blocks)
        b.wait_idle()
        start = time.perf_counter()
        b.cache.save([req])
        times.append(time.perf_counter() - start)
        b.cache.saves.release(req.req_id)
    b.wait_idle()
    save_s = statistics.median(times)
    return {
        "bytes": nbytes,
        "save_ms": save_s * 1e3,
        "memcpy_ms": memcpy_s * 1e3,
        "ratio": save_s / memcpy_s,
    }


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank: a value measured)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def measure_save_run(size: Size, root: str) -> dict[str, Any]:
    """The forward thread's time in each ``save`` of a long run on a fresh
    cache with the default number of update buffers: its buffers' first uses
    included, ``run_startup_s`` after it opens, one step's save every
    ``run_gap_s`` (the rest of a forward pass), faster than the writer
    stores them, so it falls behind and updates are skipped. p50/p99/max of
    the saves that copied (a skip copies nothing), next to a memcpy of the
    same bytes right after each of them (the same moment's conditions: the
    writer busy on the other cores): "one memcpy" is their median."""
    default = VineyardLLMCacheConfig().max_inflight_tasks
    b = Bench(size, root, max_inflight_tasks=default)
    step = size.step_tokens
    blocks = list(range(step // size.block_size))
    nbytes = len(blocks) * b.layout.payload_bytes
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # backed: a warm memcpy
    try:
        time.sleep(size.run_startup_s)
        copied: list[float] = []
        memcpys: list[float] = []
        skipped = 0
        for i in range(size.run_saves):
            req = SaveRequest(f"r{i}", b.new_prompt()[: len(blocks)], step, blocks)
            start = time.perf_counter()
            submitted = b.cache.save([req])
            elapsed = time.perf_counter() - start
            b.cache.saves.release(req.req_id)
            if submitted:
                copied.append(elapsed)
                start = time.perf_counter()
                dst.copy_(src)
                memcpys.append(time.perf_counter() - start)
            else:
                skipped += 1
            time.sleep(size.run_gap_s)
        b.wait_idle()
    finally:
        b.close()
    p50, p99, top = (1e3 * _quantile(copied, q) for q in (0.5, 0.99, 1.0))
    memcpy_ms = 1e3 * statistics.median(memcpys)
    return {
        "saves": size.run_saves,
        "copied": len(copied),
        "skipped": skipped,
        "buffers": default,
        "p50_ms": p50,
        "p99_ms": p99,
        "max_ms": top,
        "memcpy_ms": memcpy_ms,
        "memcpy_max_ms": 1e3 * max(memcpys),
        "p99_ratio": p99 / memcpy_ms,
        "max_ratio": top / memcpy_ms,
        # The machine's own tail: a memcpy's longest in the same run.
        "max_vs_memcpy_max": top / (1e3 * max(memcpys)),
    }


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    def med(get: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(get(r) for r in repeats)

    read_ratio = med(lambda r: r["readv_vs_read"])
    save_ratio = med(lambda r: r["save"]["ratio"])
    # The run's worst repeat: a tail target holds in every run or not at all.
    run_p99_ratio = max(r["save_run"]["p99_ratio"] for r in repeats)
    return {
        "write_gbps": med(lambda r: r["checksum"]["write_gbps"]),
        "writev_gbps": med(lambda r: r["writev_gbps"]),
        "read_gbps": med(lambda r: r["checksum"]["read_gbps"]),
        "read_keyed_gbps": med(lambda r: r["keyed"]["read_gbps"]),
        "readv_gbps": med(lambda r: r["readv_gbps"]),
        "readv_vs_read": read_ratio,
        "save_vs_memcpy": save_ratio,
        "save_run_p99_vs_memcpy": run_p99_ratio,
        "lookup_bytes_read": max(r["lookup"]["bytes_read_delta"] for r in repeats),
        "targets": {
            "read_within_1.3x_of_readv": read_ratio <= TARGET_READ_VS_READV,
            "save_within_1.2x_of_memcpy": save_ratio <= TARGET_SAVE_VS_MEMCPY,
            "save_p99_within_1.2x_of_memcpy": run_p99_ratio <= TARGET_SAVE_VS_MEMCPY,
            "lookups_read_no_kv": all(
                r["lookup"]["bytes_read_delta"] == 0 for r in repeats
            ),
        },
    }


def print_report(size: Size, repeats: list[dict[str, Any]]) -> None:
    s = size
    kv_token = (
        2
        * s.num_layers
        * s.num_kv_heads
        * s.head_size
        * (2 if s.dtype == "bfloat16" else 4)
    )
    print(
        f"\nLayout: {s.num_layers} layers, {s.num_kv_heads} KV heads x "
        f"{s.head_size}, {s.dtype} ({kv_token // 1024} KiB of KV per token), "
        f"block {s.block_size}, chunk {s.chunk_size}; prompt of "
        f"{s.num_tokens} tokens ({repeats[0]['bytes'] / 2**20:.0f} MiB), "
        f"median of {s.iters}"
    )
    head = ("repeat", "write", "writev", "w ratio", "read", "read+MAC", "readv",
            "readv/read", "save ms", "memcpy ms", "save/memcpy", "lookup us",
            "lookup KV bytes")  # fmt: skip
    print(" | ".join(head))
    for i, r in enumerate(repeats):
        c, k, sv, lk = r["checksum"], r["keyed"], r["save"], r["lookup"]
        row = (str(i + 1), f"{c['write_gbps']:.2f}", f"{r['writev_gbps']:.2f}",
               f"{r['write_vs_writev']:.2f}", f"{c['read_gbps']:.2f}",
               f"{k['read_gbps']:.2f}", f"{r['readv_gbps']:.2f}",
               f"{r['readv_vs_read']:.2f}x", f"{sv['save_ms']:.1f}",
               f"{sv['memcpy_ms']:.1f}", f"{sv['ratio']:.2f}x",
               f"{lk['hit_us']:.0f}", str(lk["bytes_read_delta"]))  # fmt: skip
        print(" | ".join(row))
    print("(GB/s; read = load through the cache, checksum verified; "
          "read+MAC = with auth_key_file)")  # fmt: skip
    print(
        "\nWhere a load's time goes (ms, median; the reader reads, then "
        "verifies; the copy into the KV blocks overlaps the next read; "
        "x = speed as a share of readv's):"
    )
    print("repeat | check | read | verify | copy | load | readv | "
          "read alone/readv | read+verify/readv | load/readv")  # fmt: skip
    for i, r in enumerate(repeats):
        for name in ("checksum", "keyed"):
            ph, m = r[name]["phases_ms"], r[name]
            print(f"{i + 1} | {name} | {ph['read']:.1f} | {ph['verify']:.1f} | "
                  f"{ph['copy']:.1f} | {ph['load']:.1f} | {r['readv_ms']:.1f} | "
                  f"{m['read_alone_vs_readv']:.2f}x | "
                  f"{m['read_verify_vs_readv']:.2f}x | "
                  f"{r['readv_ms'] / ph['load']:.2f}x")  # fmt: skip
    print(
        "\nReads and verification at once: a load's median ms with one reader "
        "and with two (each reads and verifies its own segments), this process "
        "(which copies) on its one core or on every core; x = speed as a share "
        "of readv's:"
    )
    print("repeat | check | cores | 1 reader | 2 readers | 2 vs 1 | "
          "1 reader/readv | 2 readers/readv")  # fmt: skip
    for i, r in enumerate(repeats):
        rd = r["readers"]
        for name in ("checksum", "keyed"):
            for cores in ("one", "every"):
                one, two = rd[f"{name}/{cores}/1"], rd[f"{name}/{cores}/2"]
                print(f"{i + 1} | {name} | {cores} | {one:.1f} | {two:.1f} | "
                      f"{one / two:.2f}x | {r['readv_ms'] / one:.2f}x | "
                      f"{r['readv_ms'] / two:.2f}x")  # fmt: skip
    print(
        f"\nForward thread per save over a run of {s.run_saves} steps, one every "
        f"{1e3 * s.run_gap_s:.0f} ms, on a fresh cache from {s.run_startup_s:g} s "
        "after it opens (first uses included; the writer falls behind):"
    )
    run_head = ("repeat", "buffers", "copied", "skipped", "p50 ms", "p99 ms",
                "max ms", "memcpy ms (median, max)", "p99/memcpy",
                "max/memcpy", "max/memcpy max")  # fmt: skip
    print(" | ".join(run_head))
    for i, r in enumerate(repeats):
        run = r["save_run"]
        run_row = (str(i + 1), str(run["buffers"]), str(run["copied"]),
               str(run["skipped"]), f"{run['p50_ms']:.1f}", f"{run['p99_ms']:.1f}",
               f"{run['max_ms']:.1f}",
               f"{run['memcpy_ms']:.1f}, {run['memcpy_max_ms']:.1f}",
               f"{run['p99_ratio']:.2f}x", f"{run['max_ratio']:.2f}x",
               f"{run['max_vs_memcpy_max']:.2f}x")  # fmt: skip
        print(" | ".join(run_row))
    t = summarize(repeats)["targets"]
    print(f"targets: read within {TARGET_READ_VS_READV}x of readv: "
          f"{t['read_within_1.3x_of_readv']}; save within "
          f"{TARGET_SAVE_VS_MEMCPY}x of memcpy: {t['save_within_1.2x_of_memcpy']}; "
          f"p99 save of the run within {TARGET_SAVE_VS_MEMCPY}x: "
          f"{t['save_p99_within_1.2x_of_memcpy']}; "
          f"lookups read no KV: {t['lookups_read_no_kv']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="whole repeats")
    add_size_arguments(parser)
    args = parser.parse_args(argv)
    size = size_of(args)
    pin_like_a_forward_pass()
    repeats = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        for i in range(args.repeats):
            repeats.append(measure(size, os.path.join(workdir, f"repeat{i}")))
    print_report(size, repeats)
    result = {"size": asdict(size), "repeats": repeats, "summary": summarize(repeats)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
