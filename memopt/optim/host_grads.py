"""ZeRO-Offload's gradient path: each flat group's owned gradient leaves the device as soon as it is
reduced, during the backward, into a persistent fp32 host buffer (Ren et al. 2021, section 4.1).

``FlatGroup`` hands every reduced bucket (its owned range) to ``HostGrad.receive`` the moment its
reduce-scatter (zero2/zero3) or all-reduce (ddp/zero1, last micro-step) completes, so the device keeps
no gradient shard between the backward and the step, and the host step finds fp32 gradients ready.

On CUDA the copy runs on one side stream shared by the groups into pinned memory (non-blocking:
the backward continues while the bucket travels) and the device bucket is kept alive for that
stream (``record_stream``); micro-batches after the first go through a pinned staging buffer and are
added on the host. On a CPU-only machine the same calls copy synchronously and the buffer is counted
as ``host`` by the tracker (``host_scope``).
"""
from __future__ import annotations

import torch


class HostGrad:
    """One flat group's owned fp32 gradient on the host, filled during the backward."""

    def __init__(self, numel: int, device: torch.device, tracker, stream=None):
        self.cuda = device.type == "cuda"
        with tracker.category("grads"), tracker.host_scope():
            self.buf = torch.zeros(numel, dtype=torch.float32, device="cpu", pin_memory=self.cuda)
        self.stream, self.tracker = stream, tracker
        self.staging: torch.Tensor | None = None
        self.event = None

    def receive(self, g: torch.Tensor, accumulate: bool) -> torch.Tensor:
        """Copy (first micro-batch of a step) or add (later ones) the reduced owned range ``g``."""
        if not self.cuda:  # same memory: one synchronous pass (bf16 -> fp32 conversion included)
            if accumulate:
                self.buf.add_(g)
            else:
                self.buf.copy_(g)
            return self.buf
        self.wait()
        self.stream.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(self.stream):
            if accumulate:
                if self.staging is None or self.staging.dtype != g.dtype:
                    with self.tracker.category("grads"), self.tracker.host_scope():
                        self.staging = torch.empty(g.numel(), dtype=g.dtype, device="cpu", pin_memory=True)
                self.staging.copy_(g, non_blocking=True)
            else:
                self.buf.copy_(g, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        g.record_stream(self.stream)  # the allocator keeps g until the copy is done
        if accumulate:
            self.wait()
            self.buf.add_(self.staging)
        return self.buf

    def wait(self) -> None:
        """Block until this group's last copy has landed (a no-op on CPU)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def attach_host_grads(groups: list, tracker) -> list[HostGrad]:
    """Give every flat group a host gradient buffer (one side stream for all of them on CUDA)."""
    dev = groups[0].device if groups else torch.device("cpu")
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    out = []
    for g in groups:
        g.host_grad = HostGrad(g.owned_size, dev, tracker, stream)
        out.append(g.host_grad)
    return out
