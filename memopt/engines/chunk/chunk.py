"""Chunks and tensor states (PatrickStar's chunk/tensor model).

A ``Chunk`` is a fixed number of elements of one dtype that moves between the host and the compute
device *whole*. It has two storages, one per place, and at most one of them is allocated:

* ``dev``: a tensor on the compute device. Parameters are views of it, for their whole life: when the
  chunk leaves the device the storage is resized to 0 bytes (the views stay valid objects) and when
  it comes back the storage is refilled, so tensors that autograd saved in the forward (e.g. the
  ``weight.t()`` of a linear layer) see the same data in the backward, wherever the chunk was in
  between. This is the ZeRO-3 technique of ``strategies/zero.py`` applied to placement.
* ``host``: a CPU tensor (counted under ``tracker.host_scope()``, so on a CPU-only machine host and
  device bytes are told apart even though both live in RAM).

Gradients live in one of two places (``ChunkManager.reuse`` decides, per run):

* reuse (``trainer.grad_accum`` == 1, PatrickStar's scheme): a tensor's gradient is written over its
  own slice of the payload when autograd has finished it, i.e. when the backward no longer needs
  that parameter (``grad_in_payload``); the optimizer step reads the payload as the gradient and
  writes the parameters back from the fp32 master. No gradient bytes of their own.
* companion (accumulation over micro-steps needs the parameters again in the next micro-step): a
  gradient buffer of the same dtype, layout and place, allocated at the first gradient of a step
  and freed after the optimizer step.

Every byte a chunk allocates is counted under the tracker's ``chunks`` category, optimizer chunks
(fp32 master, momentum, variance) included: a chunk buffer is a chunk buffer, whatever it holds.

Tensor states (per parameter): FREE (no payload: a remote chunk in distributed runs), COMPUTE (a
module is using it now: its chunk is pinned on the device), HOLD (resident, idle), HOLD_AFTER_FWD
(used in this forward, waiting for its backward), HOLD_AFTER_BWD (its backward is done). A chunk's
state follows its tensors: COMPUTE if any tensor is, else HOLD-like if any tensor holds data, else FREE.
"""
from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass, field

import torch

DEVICE, HOST = "device", "host"


class TensorState(enum.Enum):
    FREE = 0
    COMPUTE = 1
    HOLD = 2
    HOLD_AFTER_FWD = 3
    HOLD_AFTER_BWD = 4


@dataclass
class TensorInfo:
    """Where one parameter lives: chunk, offset (elements) and shape; its state and users."""

    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    chunk: "Chunk" = None
    offset: int = 0
    state: TensorState = TensorState.HOLD
    users: int = 0  # modules currently computing with it (a tied weight can be used twice at once)
    aliases: list[str] = field(default_factory=list)  # other names of the same parameter (tied)
    grad_ready: bool = False  # its gradient of the current micro-step is in the chunk's companion

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Chunk:
    """One chunk: ``numel`` elements of ``dtype`` on the device, on the host or nowhere."""

    def __init__(self, index: int, kind: str, numel: int, dtype: torch.dtype, device: torch.device, tracker,
                 trainable: bool = True, with_grad: bool = False):
        self.index, self.kind, self.numel, self.dtype, self.device = index, kind, numel, dtype, device
        self.tracker, self.trainable, self.with_grad = tracker, trainable, with_grad
        self.tensors: list[TensorInfo] = []
        self.used = 0  # elements holding tensors (the rest is padding)
        self.dev: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.grad_dev: torch.Tensor | None = None
        self.grad_host: torch.Tensor | None = None
        self.where: str | None = None  # DEVICE | HOST | None (no payload)
        self.has_grad = False  # the gradient companion is allocated
        self.grad_in_payload = False  # reuse: the payload holds gradients (of the tensors whose gradient came)
        self.moves = 0
        self.bound = False
        self._grad_views: dict[tuple[str, int], torch.Tensor] = {}
        # distributed (comm.py): owning rank, whether that is this rank, communication unit, and
        # whether a remote payload is only kept as a cached buffer (mem_cache)
        self.owner, self.local, self.unit, self.cached = 0, True, None, False
        self.expert = False  # holds MoE expert parameters (partitioned over the expert data-parallel ranks)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def payload_bytes(self) -> int:
        return self.numel * self.element_size

    @property
    def nbytes(self) -> int:
        """Bytes this chunk occupies where it is (payload, plus the gradient companion when allocated)."""
        if self.where is None:
            return 0
        return self.payload_bytes * (2 if self.has_grad else 1)

    def fits(self, numel: int) -> bool:
        return self.used + numel <= self.numel

    def add(self, info: TensorInfo) -> None:
        info.chunk, info.offset = self, self.used
        self.used += info.numel
        self.tensors.append(info)

    # ---- state ------------------------------------------------------------------------------
    @property
    def state(self) -> TensorState:
        states = {t.state for t in self.tensors}
        if TensorState.COMPUTE in states:
            return TensorState.COMPUTE
        if self.where is None or not states or states == {TensorState.FREE}:
            return TensorState.FREE
        for s in (TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD):
            if states == {s}:
                return s
        return TensorState.HOLD

    @property
    def pinned(self) -> bool:
        return any(t.state is TensorState.COMPUTE for t in self.tensors)

    # ---- storage ----------------------------------------------------------------------------
    def _scope(self, where: str):
        stack = contextlib.ExitStack()
        stack.enter_context(self.tracker.category("chunks"))
        if where == HOST:
            stack.enter_context(self.tracker.host_scope())
        return stack

    def _register(self, t: torch.Tensor | None, where: str) -> None:
        if t is not None and self.tracker.enabled:
            self.tracker.register(t, "chunks", device="host" if where == HOST else self.tracker.compute_key)

    def _buffer(self, attr: str, where: str) -> torch.Tensor:
        """Allocate (first time) or refill the storage ``attr`` to its full size; returns it."""
        t = getattr(self, attr)
        if t is None:
            with self._scope(where):
                t = torch.empty(self.numel, dtype=self.dtype, device=self.device if where == DEVICE else "cpu")
            setattr(self, attr, t)
        elif t.untyped_storage().nbytes() == 0:
            t.untyped_storage().resize_(self.payload_bytes)
            self._register(t, where)
        return t

    def _drop(self, attr: str, where: str) -> None:
        t = getattr(self, attr)
        if t is not None and t.untyped_storage().nbytes():
            t.untyped_storage().resize_(0)
            self._register(t, where)

    def allocate(self, where: str, zero: bool = True) -> None:
        """Give the chunk a payload at ``where`` (it has none)."""
        assert self.where is None
        t = self._buffer("dev" if where == DEVICE else "host", where)
        if zero:
            t.zero_()
        self.where = where
        if where == DEVICE:
            self.bind()

    def bind(self) -> None:
        """Point every parameter at its slice of the device storage (done once; stays valid)."""
        if self.bound:
            return
        for info in self.tensors:
            info.param.data = shaped_view(self.dev, info)
        self.bound = True

    def move(self, where: str) -> None:
        """Move payload (and gradient companion) to ``where``: allocate there, copy, free here."""
        if self.where == where or self.where is None:
            return
        src, dst = ("dev", "host") if where == HOST else ("host", "dev")
        t = self._buffer(dst, where)
        t.copy_(getattr(self, src))
        if self.has_grad:
            g = self._buffer("grad_" + dst, where)
            g.copy_(getattr(self, "grad_" + src))
            self._drop("grad_" + src, self.where)
        self._drop(src, self.where)
        self.where = where
        self.moves += 1
        if where == DEVICE:
            self.bind()

    def release(self) -> None:
        """Free the payload (and gradient) wherever it is (a remote chunk in distributed runs)."""
        for attr, w in (("dev", DEVICE), ("host", HOST), ("grad_dev", DEVICE), ("grad_host", HOST)):
            self._drop(attr, w)
        self.where, self.has_grad, self.grad_in_payload = None, False, False

    @property
    def data(self) -> torch.Tensor:
        """The payload where it is now."""
        return self.dev if self.where == DEVICE else self.host

    @property
    def holds_grad(self) -> bool:
        """Some gradient of this step is in the chunk (its companion or, under reuse, its payload)."""
        return self.has_grad or self.grad_in_payload

    @property
    def grad(self) -> torch.Tensor | None:
        """Where the chunk's gradient is: the payload under reuse, else the companion (None: no gradient)."""
        if self.grad_in_payload:
            return self.data
        if not self.has_grad:
            return None
        return self.grad_dev if self.where == DEVICE else self.grad_host

    def write_grad(self, info: TensorInfo, g: torch.Tensor) -> None:
        """Reuse: ``info``'s finished gradient over its parameters in the payload (the chunk is resident)."""
        self.payload_view(info).copy_(g)
        self.grad_in_payload = True

    def seal_grads(self) -> None:
        """Reuse, before a reduce or the step reads the payload as a gradient: the slices of tensors that
        got no gradient this step still hold parameters and become zeros (a companion starts at zero)."""
        for t in self.tensors:
            if not t.grad_ready:
                self.payload_view(t).zero_()
        self.grad_in_payload = True

    def alloc_grad(self) -> torch.Tensor:
        """The gradient companion (zero-filled at allocation) where the chunk is."""
        if not self.has_grad:
            attr = "grad_dev" if self.where == DEVICE else "grad_host"
            self._buffer(attr, self.where).zero_()
            self.has_grad = True
        return self.grad

    def free_grad(self) -> None:
        self._drop("grad_dev", DEVICE)
        self._drop("grad_host", HOST)
        self.has_grad = self.grad_in_payload = False

    def view_of(self, info: TensorInfo, grad: bool = False) -> torch.Tensor:
        buf = self.grad if grad else self.data
        return buf.narrow(0, info.offset, info.numel)  # not buf[a:b]: Python indexing asks a fake tensor its device 3 times

    def grad_view(self, info: TensorInfo) -> torch.Tensor:
        """``info``'s slice of the gradient companion where the chunk is, in its shape. Made once per place
        and kept, like the parameters' views of the payload: a companion's storage is resized, never
        replaced, so the view stays valid (one op per gradient instead of three: each costs ~0.3 ms in a plan)."""
        attr = "grad_dev" if self.where == DEVICE else "grad_host"
        v = self._grad_views.get((attr, info.offset))
        if v is None:
            v = self._grad_views[(attr, info.offset)] = shaped_view(getattr(self, attr), info)
        return v

    def payload_view(self, info: TensorInfo) -> torch.Tensor:
        """``info``'s slice of the payload where the chunk is, in its shape (kept per place, as ``grad_view``)."""
        attr = "dev" if self.where == DEVICE else "host"
        v = self._grad_views.get((attr, info.offset))
        if v is None:
            v = self._grad_views[(attr, info.offset)] = shaped_view(getattr(self, attr), info)
        return v

    def __repr__(self) -> str:
        return f"Chunk({self.kind}#{self.index}, {self.numel} x {self.dtype}, {self.where}, {self.state.name})"


def shaped_view(buf: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """``info``'s slice of a chunk buffer in its shape, as one view op (``narrow(...).view(shape)`` is two,
    and in a plan every op on a fake tensor costs ~0.3 ms; 600 per rank for gpt_10b)."""
    strides, acc = [], 1
    for n in reversed(info.shape):
        strides.append(acc)
        acc *= n
    return buf.as_strided(info.shape, tuple(reversed(strides)), buf.storage_offset() + info.offset)
