"""The torch runtime's device: which one serves, and copies to and from a GPU.

With ``parameters.pinned: true``, a batch's inputs are copied into pinned (page-locked) host
buffers, which the GPU reads by DMA while the CPU goes on, on a stream of their own that the
compute stream waits for; its outputs come back into pinned buffers, with one synchronisation
for them all. The buffers are reused from batch to batch (one per tensor, grown as batches
grow): pinning memory is slow.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from tailserve.errors import ModelLoadError

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda")


def choose_device(providers: list[str], where: str) -> torch.device:
    """CUDA where ``instances.providers`` puts ``cuda`` before ``cpu`` and torch sees a GPU
    (the first visible one: `tailserve up` gives each worker its own); else the CPU."""
    for name in providers:
        provider = name.lower()
        if provider not in DEVICES:
            raise ModelLoadError(
                f"{where}: field 'instances.providers': torch serves on cpu or cuda, not {name!r}"
            )
        if provider == "cpu":
            break
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        log.warning("%s: CUDA asked for but not available; serving on the CPU", where)
        break
    return torch.device("cpu")


class PinnedTransfer:
    """Host to device and back for one model instance (one thread at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def inputs(
        self, arrays: list[np.ndarray[Any, Any] | None], rows: int | None
    ) -> list[torch.Tensor | None]:
        """The arrays on the device, issued on the copy stream; the current (compute) stream
        waits for them. ``rows`` above an array's own pads it with copies of its first row."""
        compute = torch.cuda.current_stream(self.device)
        staged: list[torch.Tensor | None] = []
        for i, array in enumerate(arrays):
            if array is None:
                staged.append(None)
                continue
            shape = list(array.shape)
            if rows is not None and rows > shape[0]:
                shape[0] = rows
            host = self._buffer(("in", i), torch.from_numpy(array[:0]).dtype, shape)
            view = host.numpy()
            view[: len(array)] = array
            view[len(array) :] = array[:1]
            staged.append(host)
        # (The previous batch's copies were done before its outputs' synchronisation returned,
        # so its buffers were free to refill.)
        on_device: list[torch.Tensor | None] = []
        with torch.cuda.stream(self.stream):
            for pinned in staged:
                on_device.append(
                    None if pinned is None else pinned.to(self.device, non_blocking=True)
                )
        compute.wait_stream(self.stream)
        for tensor in on_device:
            if tensor is not None:
                # Allocated on the copy stream, used on the compute stream: the allocator must
                # not hand its memory out again before the compute stream is done with it.
                tensor.record_stream(compute)
        return on_device

    def outputs(self, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray[Any, Any]]:
        """The tensors in host memory: copied into pinned buffers, one synchronisation, then
        out of them (the buffers are the next batch's)."""
        compute = torch.cuda.current_stream(self.device)
        hosts = {}
        for i, (name, tensor) in enumerate(tensors.items()):
            host = self._buffer(("out", i), tensor.dtype, list(tensor.shape))
            host.copy_(tensor, non_blocking=True)
            hosts[name] = host
        compute.synchronize()
        return {name: host.numpy().copy() for name, host in hosts.items()}

    def _buffer(self, key: tuple[str, int], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A pinned view of ``shape`` over the reusable buffer for ``key``, grown (doubled) when
        too small."""
        count = int(np.prod(shape))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < count:
            size = max(count, 2 * buffer.numel() if buffer is not None else 0, 1)
            buffer = torch.empty(size, dtype=dtype, pin_memory=True)
            self._buffers[key] = buffer
        return buffer[:count].view(shape)
