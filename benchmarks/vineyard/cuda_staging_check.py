# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks the cache's CUDA copies between vLLM's paged KV cache and its
pinned staging entries, where only torch and a GPU exist (no vLLM, no
downloads): it loads ``vllm/worker/vineyard/transfer/kv_copy.py`` by path.

On FlashAttention's layout (``[2, num_blocks, block_size, heads, head]`` per
layer, bf16) it checks, for a spread of copy sizes:

- the bytes: a gather yields each block's layers in the storage order, a
  scatter puts them back;
- ordering: the copy sees what the compute stream wrote just before it, and
  the compute stream's next write to the blocks does not reach the copy;
- the forward thread is not blocked: with the compute stream busy for
  ~200 ms, the gather and scatter calls return within a few ms;
- speed: the gather (device to pinned host) and scatter (pinned host to
  device) against one ``cudaMemcpyAsync`` of the same bytes, and the
  earlier per-layer copy into strided host views for reference.

Exits non-zero when a check fails.

    python benchmarks/vineyard/cuda_staging_check.py
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

KV_COPY = (
    Path(__file__).resolve().parents[2]
    / "vllm"
    / "worker"
    / "vineyard"
    / "transfer"
    / "kv_copy.py"
)
TRAILER_BYTES = 64  # the entry's trailer (digest), filled by the backend
#: The forward thread may spend this long in a copy call (launches only).
MAX_CALL_S = 0.02
BUSY_S = 0.2


def load_kv_copy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kv_copy", KV_COPY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pinned_entries(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Shared memory page-locked with cudaHostRegister, as the cache's
    staging memory is (not torch's pinned allocator)."""
    element = torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, rows * width * element)
    tensor = torch.frombuffer(memory, dtype=dtype).view(rows, width)
    tensor.view(torch.uint8).fill_(0)
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    assert int(err) == 0, f"cudaHostRegister failed: {err}"
    return tensor


def busy(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds``."""
    torch.cuda._sleep(int(seconds * 1.5e9))  # cycles at a ~1.5 GHz clock


def timed(fn: Callable[[], object], repeat: int = 5) -> float:
    """Median wall seconds of ``fn()`` until the device is idle."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def strided_gather(
    kvs: list[torch.Tensor], index: torch.Tensor, entries: torch.Tensor
) -> None:
    """The copy this replaces: per layer into a strided pinned view."""
    e = kvs[0][:, 0].numel()
    for layer, kv in enumerate(kvs):
        blocks = kv.transpose(0, 1).index_select(0, index).reshape(len(index), -1)
        entries[:, layer * e : (layer + 1) * e].copy_(blocks, non_blocking=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 2
    kv_copy = load_kv_copy()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    shape = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_size)
    kvs = [torch.randn(shape, dtype=dtype, device=device) for _ in range(args.layers)]
    block_bytes = kvs[0][:, 0].numel() * kvs[0].element_size()
    copier = kv_copy.KVBlockCopier(kvs, args.num_blocks, block_bytes)
    assert copier.staged
    payload = copier.payload_elems
    width = payload + TRAILER_BYTES // kvs[0].element_size()
    most = max(args.blocks)
    entries_all = pinned_entries(most, width, dtype)
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)
            print(f"FAIL: {what}")

    def stored(block: int) -> torch.Tensor:
        return torch.cat([kv[:, block].reshape(-1) for kv in kvs]).cpu()

    print(
        f"{args.layers} layers, {block_bytes // 1024} KiB per layer and block, "
        f"{block_bytes * args.layers / 2**20:.1f} MiB per entry"
    )
    print(
        f"{'blocks':>6} {'MiB':>8} {'gather':>10} {'memcpy':>10} {'ratio':>6} "
        f"{'strided':>10} {'scatter':>10} {'memcpy':>10} {'ratio':>6} "
        f"{'call ms':>8}"
    )
    for n in args.blocks:
        entries = entries_all[:n]
        ids = list(range(3, 3 + 2 * n, 2))[:n]
        ids = [i % args.num_blocks for i in ids]
        # Bytes, and ordering with the compute stream on both sides.
        busy(BUSY_S)
        for kv in kvs:
            kv[:, ids[0]].fill_(1.5)  # written by the "forward" just before
        start = time.perf_counter()
        event = copier.gather(ids, entries)
        call_s = time.perf_counter() - start
        for kv in kvs:
            kv[:, ids[0]].fill_(-7.0)  # the compute stream's next write
        event.synchronize()
        expect(bool((entries[0, :payload].float() == 1.5).all()), f"{n}: order")
        for kv in kvs:
            kv[:, ids[0]].normal_()
        torch.cuda.synchronize()
        copier.gather(ids, entries).synchronize()
        expect(
            all(
                torch.equal(entries[r, :payload], stored(b)) for r, b in enumerate(ids)
            ),
            f"{n}: gathered bytes",
        )
        targets = [(i + 1) % args.num_blocks for i in ids]
        busy(BUSY_S)
        start = time.perf_counter()
        copier.scatter(entries, targets)
        call_s = max(call_s, time.perf_counter() - start)
        torch.cuda.synchronize()
        expect(
            all(
                torch.equal(stored(t), entries[r, :payload])
                for r, t in enumerate(targets)
            ),
            f"{n}: scattered bytes",
        )
        expect(call_s < MAX_CALL_S, f"{n}: a copy call took {call_s * 1e3:.1f} ms")

        # Speed against one contiguous copy of the same bytes.
        flat_dev = torch.empty((n, width), dtype=dtype, device=device)
        gather_s = timed(lambda: copier.gather(ids, entries))  # noqa: B023
        d2h_s = timed(lambda: entries.copy_(flat_dev, non_blocking=True))  # noqa: B023
        index = torch.tensor(ids, device=device)
        strided_s = timed(lambda: strided_gather(kvs, index, entries))  # noqa: B023
        scatter_s = timed(lambda: copier.scatter(entries, targets))  # noqa: B023
        h2d_s = timed(lambda: flat_dev.copy_(entries, non_blocking=True))  # noqa: B023
        mib = n * width * kvs[0].element_size() / 2**20
        print(
            f"{n:>6} {mib:>8.1f} {gather_s * 1e3:>9.2f}ms {d2h_s * 1e3:>9.2f}ms "
            f"{gather_s / d2h_s:>6.2f} {strided_s * 1e3:>9.2f}ms "
            f"{scatter_s * 1e3:>9.2f}ms {h2d_s * 1e3:>9.2f}ms "
            f"{scatter_s / h2d_s:>6.2f} {call_s * 1e3:>8.2f}"
        )
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
