# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Moves whole KV blocks between vLLM's paged KV cache and the cache's
staging entries (one entry = one block of every layer, then a trailer).

Blocks are opaque bytes: CPU kernels pack a block per instruction set and
CUDA backends lay layers out their own way, so nothing here looks inside a
block; it only needs each layer's tensor viewed block-major.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    into the staging entries, and a load one scatter back: one parallel
    region instead of one per layer (with more OpenMP threads than idle
    cores every region can wait a time slice for a descheduled thread)."""
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


class KVBlockCopier:
    """Gathers blocks of every layer into staging entries and scatters them
    back. On the CPU, with all layers in one allocation, each direction is a
    single indexed copy; otherwise one copy per layer (asynchronous on CUDA,
    ordered on the compute stream; the returned event marks its end)."""

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], num_blocks: int, block_bytes: int
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

    def _event(self) -> KVEvent:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def gather(self, block_ids: Sequence[int], entries: torch.Tensor) -> KVEvent:
        """Copy ``block_ids`` (all layers) into ``entries[i, :payload]``."""
        n = len(block_ids)
        payload = entries[:, : self.payload_elems]
        index = torch.tensor(block_ids, device=self.device)
        if self._all_layers is not None:
            out = payload.view(n, -1, self.block_elems)
            torch.index_select(self._all_layers, 0, index, out=out)
            return None
        e = self.block_elems
        for layer, kv in enumerate(self.blocks):
            payload[:, layer * e : (layer + 1) * e].copy_(
                kv.index_select(0, index).reshape(n, -1), non_blocking=True
            )
        return self._event()

    def scatter(self, entries: torch.Tensor, block_ids: Sequence[int]) -> KVEvent:
        """Copy ``entries[i, :payload]`` into ``block_ids`` (all layers)."""
        n = len(block_ids)
        payload = entries[:, : self.payload_elems]
        index = torch.tensor(block_ids, device=self.device)
        if self._all_layers is not None:
            src = payload.view(n, -1, self.block_elems)
            self._all_layers.index_copy_(0, index, src)
            return None
        e = self.block_elems
        for layer, kv in enumerate(self.blocks):
            part = payload[:, layer * e : (layer + 1) * e]
            part = part.to(self.device, non_blocking=True).reshape(n, *kv.shape[1:])
            kv.index_copy_(0, index, part)
        return self._event()
