"""Step inputs to CUDA through persistent pinned host buffers: one non-blocking copy per dtype.

A step's integer inputs (token ids, positions, slots, block tables, lengths ...) are built on the
host. Copying each from pageable memory is one synchronous cudaMemcpy apiece; instead they are
packed into one flat pinned buffer per dtype (kept across steps, grown when a step needs more),
copied with ONE `copy_(non_blocking=True)`, and sliced back into views on the device (vLLM keeps
persistent pinned CPU tensors the same way). Before a pinned buffer is rewritten, the copy that
last read it is waited for (an event; in practice long done: every step ends by reading its
sampled tokens back).

`packed_layout`, `pack` and `unpack` are the pure part. CPU steps never stage; PinnedStaging on a CPU
device (plain host buffers, no events) exists so the CPU tests run the decode graphs' input path.
"""
from __future__ import annotations

from typing import Sequence

import torch

ALIGN = 16     # elements: every packed field starts on a 64-byte (int32) / 128-byte (int64) boundary


def packed_layout(shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """(offset of each field, total elements) for tensors of these shapes packed one after another."""
    offsets, at = [], 0
    for shape in shapes:
        offsets.append(at)
        n = 1
        for s in shape:
            n *= s
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


def pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[int]:
    """Copy same-dtype tensors into flat at their packed_layout offsets; returns the offsets."""
    offsets, total = packed_layout([t.shape for t in tensors])
    assert flat.numel() >= total and all(t.dtype == flat.dtype for t in tensors)
    for t, o in zip(tensors, offsets):
        flat[o:o + t.numel()].view(t.shape).copy_(t)
    return offsets


def unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of flat with the given shapes at their packed_layout offsets (what pack wrote)."""
    offsets, _ = packed_layout(shapes)
    out = []
    for shape, o in zip(shapes, offsets):
        n = 1
        for s in shape:
            n *= s
        out.append(flat[o:o + n].view(*shape))
    return out


class PinnedStaging:
    """One persistent host buffer per dtype (pinned on CUDA) and the event of the last copy out of it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._copied: dict[torch.dtype, torch.cuda.Event] = {}

    def host(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The pinned buffer for dtype (at least numel elements), safe to write now."""
        ev = self._copied.get(dtype)
        if ev is not None:
            ev.synchronize()
        buf = self._host.get(dtype)
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 4096)
            buf = self._host[dtype] = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
        return buf

    def upload(self, host: torch.Tensor, out: torch.Tensor) -> None:
        """out (a flat device tensor) <- the first out.numel() elements of host, without blocking."""
        out.copy_(host[:out.numel()], non_blocking=True)
        if self.pinned:     # pragma: no cover - CUDA only
            self._copied.setdefault(host.dtype, torch.cuda.Event()).record()

    def to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Same-dtype host tensors -> device views of one fresh flat tensor, filled by one copy."""
        if not tensors:
            return []
        shapes = [t.shape for t in tensors]
        _, total = packed_layout(shapes)
        host = self.host(tensors[0].dtype, total)
        pack(tensors, host)
        dev = torch.empty(total, dtype=host.dtype, device=self.device)
        self.upload(host, dev)
        return unpack(dev, shapes)
