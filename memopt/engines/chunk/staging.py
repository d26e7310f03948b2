"""Two host buffers through which the host optimizer reads a device chunk's gradients and writes its parameters.

Why: the host step of a chunk whose payload is on the device needs that chunk's gradients on the host
and its new parameters back on the device. Copying in the payload's own dtype (2 B/param in fp16, not
a converted fp32 copy) and letting ``CPUAdamW`` write the parameters over the gradients it has just
read keeps the step's host ``temp`` at two chunks of the payload dtype. On CUDA the buffers are pinned
and the copies run on a side stream, so the gradient copy of chunk k+1 and the parameter copy of chunk
k-1 overlap the host pass over chunk k (what ZeRO-Offload gets by copying during the backward). On a
CPU device the same buffers and copies run as memcpy, so the bytes a plan counts are a GPU run's.

Order on the side stream: fetch(k+1) into a slot is issued after put(k-1) from the same slot, so a
buffer is never refilled before its parameters have left; ``host_view`` waits for the slot's last copy
before the host touches it; ``finish`` makes the compute stream wait for the last parameter copy.
"""
from __future__ import annotations

import torch


class HostStaging:
    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.bufs = [torch.empty(numel, dtype=dtype, pin_memory=self.cuda) for _ in range(2)]
        self.done: list = [None, None]  # per slot: the event of its last copy (CUDA)
        if self.cuda:  # the gradients were written on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def fetch(self, k: int, src: torch.Tensor | None) -> None:
        """Start copying ``src`` (a device chunk's gradients; None: nothing to copy) into slot ``k % 2``."""
        if src is not None:
            self._copy(k, self.bufs[k % 2].narrow(0, 0, src.numel()), src)

    def host_view(self, k: int, numel: int) -> torch.Tensor:
        """Slot ``k % 2``'s first ``numel`` elements, once its last copy has finished."""
        ev = self.done[k % 2]
        if ev is not None:
            ev.synchronize()
        return self.bufs[k % 2].narrow(0, 0, numel)

    def put(self, k: int, dst: torch.Tensor) -> None:
        """Start copying slot ``k % 2`` (the new parameters) into ``dst``."""
        self._copy(k, dst, self.bufs[k % 2].narrow(0, 0, dst.numel()))

    def _copy(self, k: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy touching slot ``k % 2``: on the side stream, its event the slot's last (CUDA); else now."""
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                self.done[k % 2] = self.stream.record_event()
        else:
            dst.copy_(src)

    def finish(self) -> None:
        """The compute stream waits for the last parameter copy (the next forward reads them)."""
        if self.cuda:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
