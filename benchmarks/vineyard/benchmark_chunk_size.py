# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What fewer, larger files per hit buy (``VINEYARD_CACHE_CHUNK_SIZE``).

With the core benchmark's cache (``benchmark_core.py``: the real backend
processes, the 8B-class KV layout), per chunk size: the write, the read and a
lookup of one prompt (its ``stat`` calls at once where the first took a
round trip, as the cache makes them, and one at a time beside it), on the
local disk and on a FUSE root where every
``stat``, ``open``, first ``read`` and ``fsync`` waits 20 ms (or each
``--latency-ms``; ``slow_fs.py``: a remote filesystem's round trip). The
write's time is how long a saved prompt takes to be visible to another
host: until its last chunk file is renamed into place. Usage::

    python benchmarks/vineyard/benchmark_chunk_size.py 16,64,256 \
        [--tokens 512] [--latency-ms 1 5 20] [--tiny] [--json chunks.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_core import measure_lookups  # noqa: E402
from core_harness import (  # noqa: E402
    GB,
    Bench,
    Size,
    add_size_arguments,
    pin_like_a_forward_pass,
    size_of,
    write_then_read,
)
from slow_fs import SlowFs, fuse_unavailable  # noqa: E402

from vllm.worker.vineyard.storage import far_calls  # noqa: E402

#: The slow root's default: a remote filesystem's round trip on every
#: ``stat`` and ``open`` and on each file's first ``read`` and ``fsync``.
LATENCY_MS = 20.0


def measure_chunk_size(size: Size, root: str, lookups: int) -> dict[str, Any]:
    """Write, read and look up one prompt with ``size.chunk_size`` tokens
    per chunk (file) at ``root``."""
    b = Bench(size, root)
    try:
        prompts, write_s, phases = write_then_read(b)
        read_s = statistics.median(p["load"] for p in phases)
        lookup = measure_lookups(b, prompts[0], n=lookups)
        one_at_a_time = lookups_one_stat_at_a_time(b, prompts[0], lookups)
        return {
            "chunk_tokens": size.chunk_size,
            "files_per_prompt": size.num_tokens // size.chunk_size,
            "write_gbps": b.prompt_bytes / write_s / GB,
            "read_gbps": b.prompt_bytes / read_s / GB,
            "write_ms": 1e3 * write_s,
            "read_ms": 1e3 * read_s,
            "lookup_ms": lookup["hit_us"] / 1e3,
            "lookup_one_at_a_time_ms": one_at_a_time["hit_us"] / 1e3,
            "lookup_hit_tokens": lookup["hit_tokens"],
            "bit_exact": b.loaded_exact(),
        }
    finally:
        b.close()


def lookups_one_stat_at_a_time(
    b: Bench, digests: list[bytes], n: int
) -> dict[str, Any]:
    """:func:`measure_lookups` with each ``stat`` made after the one before
    (as if every root were local)."""
    far_call_s = far_calls.FAR_CALL_S
    far_calls.FAR_CALL_S = math.inf
    try:
        return measure_lookups(b, digests, n=n)
    finally:
        far_calls.FAR_CALL_S = far_call_s


def measure_chunk_sweep(
    size: Size, chunk_sizes: list[int], workdir: str, latencies_ms: list[float]
) -> dict[str, Any]:
    """Every chunk size on the local disk, then on the slow FUSE root at
    each latency (or why it could not be mounted)."""
    out: dict[str, Any] = {"latency_ms": latencies_ms, "disk": [], "slow fs": []}
    for chunk in chunk_sizes:
        sized = replace(size, chunk_size=chunk)
        out["disk"].append(
            measure_chunk_size(sized, os.path.join(workdir, f"disk-{chunk}"), 50)
        )
    why = fuse_unavailable()
    if why is not None:
        out["slow fs"] = why
        return out
    for latency_ms in latencies_ms:
        for chunk in chunk_sizes:
            work = Path(workdir) / f"fuse-{latency_ms:g}ms-{chunk}"
            try:
                fs = SlowFs(work, latency_ms, latency_ms)
            except RuntimeError as e:  # e.g. a container without FUSE permission
                out["slow fs"] = str(e)
                return out
            try:
                sized = replace(size, chunk_size=chunk)
                row = measure_chunk_size(sized, str(fs.mount), 3)
                out["slow fs"].append({"latency_ms": latency_ms, **row})
            finally:
                fs.close()
    return out


def print_chunk_sweep(size: Size, sweep: dict[str, Any]) -> None:
    print(
        f"\nChunk sizes: one prompt of {size.num_tokens} tokens, block "
        f"{size.block_size}, {size.num_layers} layers; median of {size.iters}; "
        "slow fs: L ms on every stat and open, first read and fsync"
    )
    print("root | chunk tokens | files | write GB/s | read GB/s | write ms | "
          "read ms | lookup ms | one stat at a time | exact")  # fmt: skip
    for root in ("disk", "slow fs"):
        rows = sweep[root]
        if isinstance(rows, str):
            print(f"{root} | skipped: {rows}")
            continue
        for r in rows:
            where = f"{root} {r['latency_ms']:g} ms" if "latency_ms" in r else root
            print(f"{where} | {r['chunk_tokens']} | {r['files_per_prompt']} | "
                  f"{r['write_gbps']:.3f} | {r['read_gbps']:.3f} | "
                  f"{r['write_ms']:.0f} | {r['read_ms']:.0f} | "
                  f"{r['lookup_ms']:.1f} | {r['lookup_one_at_a_time_ms']:.1f} | "
                  f"{r['bit_exact']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "chunk_sizes", metavar="TOKENS,...", help="chunk sizes (multiples of the block)"
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        nargs="+",
        default=[LATENCY_MS],
        metavar="L",
        help="the slow root's round trips (ms), a set of rows each",
    )
    add_size_arguments(parser)
    args = parser.parse_args(argv)
    size = size_of(args)
    pin_like_a_forward_pass()
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        sweep = measure_chunk_sweep(size, chunk_sizes, workdir, args.latency_ms)
    print_chunk_sweep(size, sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": asdict(size), "chunk_sweep": sweep}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
