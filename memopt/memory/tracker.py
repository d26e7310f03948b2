"""Live tensor-storage bytes per device and category, with their peaks.

A ``TorchDispatchMode`` sees every tensor an op returns. The first time a storage is seen it is
counted under (device, category), and a weak-reference finalizer subtracts it when the storage is
freed. Peaks are kept per (device, category) and for each device's total.

Categories (what the run records report):
  params       model parameters (the low-precision copy under mixed precision)
  grads        parameter gradients (re-tagged by a post-accumulate-grad hook)
  optim        optimizer states and fp32 master weights (ZeRO's "K" bytes per parameter)
  activations  storages a forward (or a checkpoint's recomputation) allocates and that are still
               alive when it returns: what autograd keeps for the backward pass
  temp         short-lived storages: forward transients, backward work, evaluation
  chunks       chunk-engine buffers
  comm         communication buffers that model parts allocate (MoE all-to-all dispatch and combine)
  other        everything else (batches, buffers, gradient-bucket scratch)

Devices: the compute device ("cuda:0" or "cpu") and "host". On a GPU machine CPU tensors are
"host". On a CPU-only machine offload strategies place tensors on the host explicitly
(``tracker.host_scope()`` or ``register(..., device="host")``) so the move stays visible even
though the bytes live in the same RAM.

Why a dispatch mode rather than allocator statistics: it works on every device (CPU included),
splits by category, and counts what the program holds live, not what the caching allocator keeps.
On CUDA the allocator's own peak is recorded beside it (``cuda_allocator_peak``).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

CATEGORIES = ("params", "grads", "optim", "activations", "temp", "chunks", "comm", "other")
HOST = "host"


class DeviceBudgetExceeded(torch.OutOfMemoryError):
    """The compute device's tracked bytes went over the run's device budget (``MemoryTracker.budget``)."""


@dataclass
class _Info:
    device: str
    category: str
    nbytes: int


class MemoryTracker(TorchDispatchMode):
    """Counts live storage bytes; use as a context manager around the work to measure."""

    enabled = True
    _window: list | None = None  # allocation events of a ``placed_at_exit`` block

    def __init__(self, compute_device: torch.device | str = "cpu", budget: int | None = None,
                 budget_name: str = "hardware.device_memory_gb"):
        super().__init__()
        # the compute device's budget in bytes: the op whose output takes the device's live bytes over it
        # raises DeviceBudgetExceeded there and then (once), so a run ends ``oom`` at the crossing
        self.budget, self._budget_name = budget, budget_name
        self.compute_device = torch.device(compute_device)
        self._compute_key = str(self.compute_device) if self.compute_device.type != "cuda" else f"cuda:{self.compute_device.index or 0}"
        self._info: dict[int, _Info] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.live: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.peak: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._category = ["other"]
        self._host_depth = 0
        self._captures: list[list[int]] = []
        self._lock = threading.RLock()

    # ---- categories and placement -------------------------------------------------------
    @contextlib.contextmanager
    def category(self, name: str):
        """New storages created inside the block are counted under ``name``."""
        if name not in CATEGORIES and not name.startswith("_"):
            raise ValueError(f"unknown memory category {name!r}; expected one of {CATEGORIES}")
        self._category.append(name)
        try:
            yield
        finally:
            self._category.pop()

    grad_path_depth = 0  # inside ``grad_path``

    @contextlib.contextmanager
    def grad_path(self):
        """The engine's own gradient handling (a reduction's copies into a flat buffer): the planner counts the
        bytes of its ops apart (``grad_op_bytes``), where DeepSpeed's rules put DeepSpeed's in their place."""
        self.grad_path_depth += 1
        try:
            yield
        finally:
            self.grad_path_depth -= 1

    @contextlib.contextmanager
    def retained(self, name: str = "activations", transient: str = "_forward"):
        """New storages count as ``transient`` while the block runs; those still alive when it
        exits are re-tagged ``name``. Wrapped around a forward pass this makes ``activations``
        exactly what autograd keeps for the backward. Until the block exits nobody knows which of
        its storages will be kept, so they are counted only in the device total (a category whose
        name starts with "_" has no peak of its own)."""
        self._captures.append([])
        try:
            with self.category(transient):
                yield
        finally:
            keys = self._captures.pop()
            with self._lock:
                for key in keys:
                    info, ref = self._info.get(key), self._refs.get(key)
                    if info is None or ref is None or ref() is None or info.category != transient:
                        continue
                    self.live[info.device][info.category] -= info.nbytes
                    info.category = name
                    self.live[info.device][name] += info.nbytes
                    self._update_peak(info.device)

    @contextlib.contextmanager
    def host_scope(self):
        """New storages created inside the block count as host memory (offload on CPU-only machines)."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    @contextlib.contextmanager
    def placed_at_exit(self):
        """Storages created inside the block and still alive when it exits are counted from their
        creation on the device they are on at its exit (their categories change when they are
        re-tagged, as always); the block's peaks are replayed from its events in order. For a library
        that allocates host buffers itself, which the engine can only re-tag after the call
        (DeepSpeed's offload buffers, made by ``initialize``): on a GPU they are host memory from their
        birth, on a CPU-only machine they would otherwise count under the device until the re-tag. A block inside
        another is part of the outer one (its replay covers both)."""
        if self._window is not None:
            yield
            return
        with self._lock:
            live0 = {d: dict(c) for d, c in self.live.items()}
            peak0 = {d: dict(c) for d, c in self.peak.items()}
            self._window = events = []
        try:
            yield
        finally:
            with self._lock:
                self._window = None
                crossed = self._replay(events, live0, peak0)
        # judged on the replay, where each storage ended, not at its birth (on a normal exit: an exception propagates)
        if crossed is not None:
            self._over_budget(*crossed)

    def _replay(self, events: list, live0: dict, peak0: dict) -> tuple | None:
        """Recount a ``placed_at_exit`` block's events with each storage on its device at the exit; returns the first
        move that took the compute device over the budget, as ``_over_budget``'s arguments (else None)."""
        born, final = {}, {}  # storage key -> its birth event; birth event -> its device at exit
        for i, (kind, key, *_) in enumerate(events):
            if kind == "new":
                born[key] = i
            elif kind == "free":
                born.pop(key, None)
        for key, i in born.items():
            if key in self._info:
                final[i] = self._info[key].device
        live, nest = self.live, lambda: defaultdict(lambda: defaultdict(int))
        self.live, self.peak = nest(), nest()
        for src, dst in ((live0, self.live), (peak0, self.peak)):
            for d, cats in src.items():
                dst[d].update(cats)
        placed = {}  # storage key born in the block -> (device, category, bytes) counted for it now
        crossed = None
        for i, (kind, key, *where) in enumerate(events):
            if kind == "new":
                dev, cat, n = where[0]
                placed[key] = (final.get(i, dev), cat, n)
                moves = [(placed[key], 1)]
            elif kind == "free":
                moves = [(placed.pop(key, where[0]), -1)]
            elif key in placed:  # a re-tag of a storage born in the block: its category moves, on its final device
                old = placed[key]
                placed[key] = (old[0], where[1][1], where[1][2])
                moves = [(old, -1), (placed[key], 1)]
            else:  # a re-tag of an older storage
                moves = [(where[0], -1), (where[1], 1)]
            for (dev, cat, n), sign in moves:
                self.live[dev][cat] += sign * n
                total = self._update_peak(dev)
                if (crossed is None and sign > 0 and self.budget is not None and total > self.budget
                        and dev == self._compute_key):
                    crossed = (_Info(dev, cat, n), total, dict(self.live[dev]))  # the categories at the crossing
        self.live = live  # the replay ends where counting stands
        for dev in list(live):
            self._update_peak(dev)
        return crossed

    def _device_key(self, t: torch.Tensor) -> str | None:
        dev = t.device
        if dev.type == "meta":
            return None
        if self._host_depth or (dev.type == "cpu" and self.compute_device.type != "cpu"):
            return HOST
        if dev.type == "cuda":
            return f"cuda:{dev.index or 0}"
        return str(dev)

    # ---- bookkeeping --------------------------------------------------------------------
    def _track(self, t: torch.Tensor, category: str, device: str | None = None, retag: bool = False) -> None:
        if not self._counted(t):  # not a tensor, or a subclass accounted through its inner tensors
            return
        if t.layout != torch.strided or t.device.type == "meta":  # not ``is_meta``: on a fake tensor that is an op through the dispatch modes (~50 us)
            return
        st = t.untyped_storage()
        key = id(st)
        if not retag:  # the common case, an op's output whose storage is known already (views, in-place ops): no lock
            info, ref = self._info.get(key), self._refs.get(key)
            if info is not None and ref is not None and ref() is st:
                return
        with self._lock:
            info = self._info.get(key)
            if info is not None and self._refs[key]() is st:
                if not retag:
                    return
                old = (info.device, info.category, info.nbytes)
                self.live[info.device][info.category] -= info.nbytes
                info.category = category
                if device is not None:
                    info.device = device
                info.nbytes = st.nbytes()
                self.live[info.device][info.category] += info.nbytes
                if self._window is not None:
                    self._window.append(("retag", key, old, (info.device, info.category, info.nbytes)))
            else:
                dev = device or self._device_key(t)
                if dev is None:
                    return
                info = _Info(dev, category, st.nbytes())
                self._info[key] = info
                self._refs[key] = weakref.ref(st, lambda _r, k=key: self._release(k))
                self.live[dev][category] += info.nbytes
                if self._window is not None:
                    self._window.append(("new", key, (dev, category, info.nbytes)))
                if self._captures:
                    self._captures[-1].append(key)
            total = self._update_peak(info.device)
            # inside a ``placed_at_exit`` block a storage's device is known at the block's exit: judged there
            if self.budget is not None and total > self.budget and info.device == self._compute_key and self._window is None:
                self._over_budget(info, total)

    def _over_budget(self, info: _Info, total: int, at: dict[str, int] | None = None) -> None:
        """Raise DeviceBudgetExceeded for the op whose output took the device's live bytes to ``total`` (``at``: the
        device's categories then, where they are not the live ones: a ``placed_at_exit`` block's replay)."""
        live: dict[str, int] = defaultdict(int)  # a forward's transient bytes are the activations it is making
        for c, b in (self.live[info.device] if at is None else at).items():
            live["activations" if c == "_forward" else c.lstrip("_")] += b
        budget, self.budget = self.budget, None  # once: what runs while the error unwinds is not refused again
        largest = max(live, key=live.get)
        raise DeviceBudgetExceeded(
            f"device budget exceeded on {info.device}: {total} B live > {self._budget_name} = {budget} B, crossed by "
            f"{info.nbytes} B of {'activations' if info.category == '_forward' else info.category} (largest category "
            f"{largest}: {live[largest]} B)")

    @staticmethod
    def _counted(t: torch.Tensor) -> bool:
        """Plain tensors and parameters own storage; tensor subclasses (DTensor, fake tensors) are
        accounted through their inner tensors (the planner's tracker also counts fake tensors)."""
        return type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)

    def _release(self, key: int) -> None:
        with self._lock:
            info = self._info.pop(key, None)
            self._refs.pop(key, None)
            if info is not None:
                self.live[info.device][info.category] -= info.nbytes
                if self._window is not None:
                    self._window.append(("free", key, (info.device, info.category, info.nbytes)))

    def _update_peak(self, device: str) -> int:
        live, peak = self.live[device], self.peak[device]
        total = 0
        for cat, b in live.items():
            total += b
            if b > peak[cat] and cat[0] != "_":
                peak[cat] = b
        if total > peak["total"]:
            peak["total"] = total
        return total

    def register(self, t: torch.Tensor, category: str, device: str | None = None) -> None:
        """Count (or re-tag) a tensor that exists already, e.g. parameters or a grad."""
        self._track(t, category, device=device, retag=True)

    def count(self, t: torch.Tensor) -> None:
        """Count a tensor made where the dispatch mode could not see it (a compiled region's outputs and
        saved tensors) under the current category; a storage counted already is left as it is."""
        self._track(t, self._category[-1])

    def register_module(self, module: torch.nn.Module) -> None:
        """Parameters as ``params``, buffers as ``other``, and a hook that tags grads as ``grads``."""
        for p in module.parameters():
            self.register(p, "params")
            if p.requires_grad and not getattr(p, "_memopt_grad_hooked", False):
                p.register_post_accumulate_grad_hook(lambda q: self.register(q.grad, "grads"))
                p._memopt_grad_hooked = True
        for b in module.buffers():
            self.register(b, "other")

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    self.register(v, "optim")

    # ---- dispatch -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self._run(func, args, kwargs)
        cat = self._category[-1]
        if type(out) is torch.Tensor:  # most ops: one plain tensor, no pytree walk
            self._track(out, cat)
        elif type(out) in (tuple, list):
            for t in out:
                if type(t) is torch.Tensor:
                    self._track(t, cat)
                elif t is not None and not isinstance(t, (int, float, bool)):
                    for u in tree_iter(t):
                        self._track(u, cat)
        elif out is not None:
            for t in tree_iter(out):
                self._track(t, cat)
        return out

    def _run(self, func, args, kwargs):
        """The op itself (the planner's tracker answers some fake ops directly: planner/fast_ops.py)."""
        return func(*args, **(kwargs or {}))

    # ---- results ------------------------------------------------------------------------
    def reset_peaks(self) -> None:
        """Start a new peak window at the current live bytes."""
        with self._lock:
            self.peak = defaultdict(lambda: defaultdict(int))
            for dev in list(self.live):
                self._update_peak(dev)

    def live_bytes(self, device: str | None = None, category: str | None = None) -> int:
        devs = [device] if device else list(self.live)
        return sum(b for d in devs for c, b in self.live[d].items() if category in (None, c))

    def peaks(self) -> dict[str, dict[str, int]]:
        """{device: {category: peak bytes, ..., "total": peak of the sum}} (all categories listed)."""
        out = {}
        for dev, cats in self.peak.items():
            out[dev] = {c: int(cats.get(c, 0)) for c in CATEGORIES}
            out[dev]["total"] = int(cats.get("total", 0))
        return out

    @property
    def compute_key(self) -> str:
        return self._compute_key


def active_category(name: str):
    """``category(name)`` of the memory tracker that is measuring now, or a no-op when none is.

    For model parts that have no handle on the tracker (the MoE all-to-all tags its buffers ``comm``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryTracker):
            return mode.category(name)
    return contextlib.nullcontext()


class NullTracker:
    """The tracker's interface, doing nothing (``trainer.track_memory=false``): engines and strategies
    always get a tracker and never test for None."""

    enabled = False
    live: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def category(self, name: str):
        return contextlib.nullcontext()

    def retained(self, name: str = "activations", transient: str = "_forward"):
        return contextlib.nullcontext()

    def grad_path(self):
        return contextlib.nullcontext()

    def host_scope(self):
        return contextlib.nullcontext()

    def placed_at_exit(self):
        return contextlib.nullcontext()

    def register(self, t, category: str, device: str | None = None) -> None:
        pass

    def register_module(self, module) -> None:
        pass

    def register_optimizer(self, optimizer) -> None:
        pass

    def live_bytes(self, device: str | None = None, category: str | None = None) -> int:
        return 0

    def peaks(self) -> dict:
        return {}
