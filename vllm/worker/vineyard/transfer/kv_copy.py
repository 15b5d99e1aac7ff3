# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Moves whole KV blocks between vLLM's paged KV cache and the cache's
staging entries (one entry = one block of every layer, then a trailer).

Blocks are opaque bytes: CPU kernels pack a block per instruction set and
CUDA backends lay layers out their own way, so nothing here looks inside a
block; it only needs each layer's tensor viewed block-major.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

KVEvent = torch.cuda.Event | None


def block_view(kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View a layer's KV tensor block-major: ``[num_blocks, ...]``."""
    if kv.shape[0] == num_blocks:
        return kv
    if kv.dim() > 1 and kv.shape[1] == num_blocks:
        # e.g. FlashAttention's [2, num_blocks, block_size, heads, head_size]
        return kv.transpose(0, 1)
    raise ValueError(
        f"cannot find the block dimension ({num_blocks}) in a "
        f"KV cache tensor of shape {tuple(kv.shape)}"
    )


def layers_view(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All layers' blocks as one ``[num_blocks, num_layers, block_elems]``
    view, when the layers lie equally spaced in one allocation (as vLLM's CPU
    worker allocates them); else ``None``.

    With it a save is one gather of whole blocks of every layer straight
    into the staging entries, and a load one copy back per run of
    consecutive blocks: one parallel region per run instead of one per
    layer (with more OpenMP threads than idle cores every region can wait a
    time slice for a descheduled thread)."""
    flats = []
    for kv in layers:
        try:
            flat = kv.view(kv.shape[0], -1)
        except RuntimeError:
            return None  # blocks not contiguous inside
        if flat.stride(1) != 1:
            return None
        flats.append(flat)
    first = flats[0]
    if len(flats) == 1:
        return first.unsqueeze(1)
    step, rest = divmod(flats[1].data_ptr() - first.data_ptr(), first.element_size())
    span = (first.shape[0] - 1) * first.stride(0) + first.shape[1]
    if rest or step < span:  # out of order, misaligned or overlapping
        return None
    storage = first.untyped_storage().data_ptr()
    for i, flat in enumerate(flats):
        if (
            flat.shape != first.shape
            or flat.stride() != first.stride()
            or flat.dtype != first.dtype
            or flat.untyped_storage().data_ptr() != storage
            or flat.data_ptr() != first.data_ptr() + i * step * first.element_size()
        ):
            return None
    try:
        layers_first = first.as_strided(
            (len(flats), *first.shape), (step, *first.stride()), first.storage_offset()
        )
    except RuntimeError:
        return None
    return layers_first.transpose(0, 1)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(row, block, count)`` for each run of consecutive ids in
    ``block_ids``: rows ``[row, row + count)`` go to or come from blocks
    ``[block, block + count)``."""
    runs: list[tuple[int, int, int]] = []
    for row, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            first_row, first_block, count = runs[-1]
            runs[-1] = (first_row, first_block, count + 1)
        else:
            runs.append((row, block, 1))
    return runs


#: Device memory for staging copies through contiguous rows (CUDA): a
#: copy between device memory and a strided host view goes through a
#: pageable host temporary in PyTorch, synchronously; a contiguous one is a
#: single asynchronous ``cudaMemcpyAsync`` from or to pinned memory.
SCRATCH_BYTES = 64 << 20


class KVBlockCopier:
    """Gathers blocks of every layer into staging entries and scatters them
    back. On the CPU, with all layers in one allocation, a save is a
    single indexed copy and a load one copy per run of consecutive blocks;
    otherwise one copy per layer (and run). On CUDA the copies
    run on a side stream: the layers of a group of blocks are gathered into
    a device scratch laid out as the entries are, which then goes to the
    pinned entries in one contiguous copy (and the reverse for loads); the
    returned event marks the end, and the compute stream waits for what it
    must (see :meth:`gather` and :meth:`scatter`), never the CPU thread."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        num_blocks: int,
        block_bytes: int,
        staged: bool | None = None,
        scratch_bytes: int = SCRATCH_BYTES,
    ):
        self.blocks = [block_view(kv, num_blocks) for kv in kv_caches]
        for kv in self.blocks:
            got = kv[0].numel() * kv.element_size()
            if got != block_bytes:
                raise ValueError(f"KV block of {got} bytes, expected {block_bytes}")
        self.device = kv_caches[0].device
        self.block_elems = block_bytes // kv_caches[0].element_size()
        self.payload_elems = self.block_elems * len(self.blocks)
        self._all_layers = (
            layers_view(self.blocks) if self.device.type == "cpu" else None
        )
        #: Through the scratch (always on CUDA; ``staged`` for tests).
        self.staged = self.device.type == "cuda" if staged is None else staged
        self._scratch_bytes = scratch_bytes
        self._scratch: torch.Tensor | None = None
        self._stream = (
            torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        )

    def gather(self, block_ids: Sequence[int], entries: torch.Tensor) -> KVEvent:
        """Copy ``block_ids`` (all layers) into ``entries[i, :payload]``.
        The returned event (CUDA) marks the entries complete; the compute
        stream waits only until the blocks have been read."""
        n = len(block_ids)
        if n == 0:
            return None
        payload = entries[:, : self.payload_elems]
        if self._all_layers is not None:
            index = torch.tensor(block_ids, device=self.device)
            out = payload.view(n, -1, self.block_elems)
            torch.index_select(self._all_layers, 0, index, out=out)
            return None
        if not self.staged:
            out = payload.view(n, -1, self.block_elems)
            for row, block, count in block_runs(block_ids):
                for layer, kv in enumerate(self.blocks):
                    out[row : row + count, layer].copy_(
                        kv[block : block + count].reshape(count, -1)
                    )
            return None
        with self._on_side_stream():
            index = self._index(block_ids)
            for rows, scratch in self._groups(index, entries):
                self._gather_layers(index[rows], scratch[:, : self.payload_elems])
                read = self._event()  # the last group's: every block read
                entries[rows].copy_(scratch, non_blocking=True)
            done = self._event()
        self._compute_waits(read)  # vLLM may reuse the blocks after this
        return done

    def scatter(self, entries: torch.Tensor, block_ids: Sequence[int]) -> KVEvent:
        """Copy ``entries[i, :payload]`` into ``block_ids`` (all layers).
        The compute stream waits for the blocks; the returned event (CUDA)
        marks the entries read (the buffer may be refilled after it)."""
        n = len(block_ids)
        if n == 0:
            return None
        payload = entries[:, : self.payload_elems]
        if self._all_layers is not None or not self.staged:
            # One plain copy per run of consecutive blocks: on the CPU,
            # index_copy_ into the strided KV measured half a memcpy's speed,
            # these copies a memcpy's.
            src = payload.view(n, -1, self.block_elems)
            for row, block, count in block_runs(block_ids):
                run = src[row : row + count]
                if self._all_layers is not None:
                    self._all_layers[block : block + count].copy_(run)
                    continue
                for layer, kv in enumerate(self.blocks):
                    kv[block : block + count].copy_(
                        run[:, layer].reshape(count, *kv.shape[1:])
                    )
            return None
        with self._on_side_stream():
            index = self._index(block_ids)
            for rows, scratch in self._groups(index, entries):
                scratch.copy_(entries[rows], non_blocking=True)
                self._scatter_layers(scratch[:, : self.payload_elems], index[rows])
            done = self._event()
        self._compute_waits(done)  # the next forward reads these blocks
        return done

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The block ids on the device, copied from pinned memory on the
        current stream: a copy from pageable memory would wait for the
        compute stream on the CPU thread."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        if self.device.type != "cuda":
            return index.to(self.device)
        return index.pin_memory().to(self.device, non_blocking=True)

    def _groups(
        self, index: torch.Tensor, entries: torch.Tensor
    ) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(rows, scratch)`` for each group of rows that fits the scratch
        (whole entries: one contiguous copy each way)."""
        width = entries.shape[1]
        if (
            self._scratch is None
            or self._scratch.shape[1] != width
            or self._scratch.dtype != entries.dtype
        ):
            rows = max(1, self._scratch_bytes // (width * entries.element_size()))
            self._scratch = torch.empty(
                (rows, width), dtype=entries.dtype, device=self.device
            )
        rows = self._scratch.shape[0]
        for first in range(0, len(index), rows):
            last = min(first + rows, len(index))
            yield slice(first, last), self._scratch[: last - first]

    def _gather_layers(self, index: torch.Tensor, out: torch.Tensor) -> None:
        e = self.block_elems
        for layer, kv in enumerate(self.blocks):
            out[:, layer * e : (layer + 1) * e].copy_(
                kv.index_select(0, index).reshape(len(index), -1)
            )

    def _scatter_layers(self, src: torch.Tensor, index: torch.Tensor) -> None:
        e = self.block_elems
        for layer, kv in enumerate(self.blocks):
            part = src[:, layer * e : (layer + 1) * e]
            kv.index_copy_(0, index, part.reshape(len(index), *kv.shape[1:]))

    def _on_side_stream(self) -> contextlib.AbstractContextManager[object]:
        """The copies' stream, after what the compute stream has queued
        (the forward pass that wrote the blocks, or last read them)."""
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    def _event(self) -> KVEvent:
        """An event recorded on the current stream (``None`` off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _compute_waits(self, event: KVEvent) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
