"""Chunk lists, placement and the device budget.

The manager owns the parameter chunk list (parameters in the parameter dtype, packed in
registration order, which is the forward order for memopt's GPT; trainable and frozen parameters
in separate chunks so that frozen ones never get optimizer state) and decides where every chunk is.
Optimizer chunk lists (fp32 master / momentum / variance) belong to ``hybrid_adam.ChunkAdam``; the
manager only counts the bytes of those that sit on the device (``os_device_bytes``).

Budget, enforced on the manager's own accounting at every moment (see config.py for D and W):

    param/grad chunk bytes on the device <= budget(t)
    budget(t) = W                                   during warm-up, and always with static_partition
              = D - nonmodel(t) - os_device_bytes   afterwards (dynamic partition)

A moment that needs more than the budget after every evictable chunk is gone raises
``ChunkOutOfMemoryError`` (a ``torch.OutOfMemoryError``, so the run's status is ``oom``).

Eviction: after warm-up, the resident, unpinned chunk whose next use is farthest in the trace
(Belady's optimal policy: the access order of a training step repeats exactly); during warm-up,
the least recently used one. Cached remote buffers (``mem_cache``) are freed before anything moves.

With several ranks (``comm``, see comm.py) a moment that touches a unit which is not gathered makes
the whole unit resident and gathers it; the manager also tells the comm layer when a unit is done
with (release) and when its gradients are complete (reduce).
"""
from __future__ import annotations

import math

import torch

from memopt.engines.chunk.chunk import DEVICE, HOST, Chunk, TensorInfo, TensorState
from memopt.engines.chunk.tracer import MemTracer

ALIGN = 1024  # chunk sizes the search considers are multiples of this many elements


class ChunkOutOfMemoryError(torch.OutOfMemoryError):
    """The chunks one moment needs do not fit in the chunk budget (message: moment, budget, bytes).
    ``fixes``: (field, value) pairs that would make that moment fit, cheapest first (the planner applies them)."""

    fixes: tuple = ()


def _mb(b: float) -> str:
    return f"{b / 2**20:.2f} MiB ({int(b)} B)"


def pack_sizes(numels: list[int], chunk_size: int) -> int:
    """Number of chunks the greedy in-order packing uses (a tensor never spans two chunks)."""
    n, used = 0, chunk_size
    for k in numels:
        if used + k > chunk_size:
            n, used = n + 1, 0
        used += k
    return n


def search_chunk_size(groups: list[list[int]], cost=None, hi: int | None = None) -> int:
    """The multiple of ``ALIGN`` in [m, 4m] (m = the largest tensor, rounded up; ``hi``: a lower upper
    end, never below m) that minimises ``cost(counts, c)`` (the chunk counts of each group's greedy
    packing at size c; default: the padding, ``sum(counts) * c - total``) over the groups (trainable,
    expert, frozen); ties go to the smaller size (finer placement). The engine's cost, when
    ``chunk_size`` is null, is the busiest rank's bytes (``defaults.chunk_cost``).

    Exact over every aligned size, not a sample of them: the greedy in-order packing never uses more
    chunks with a larger chunk (by induction, each chunk starts at or after the tensor it starts at
    with a smaller one), so every group's count is constant between two sizes where the total count
    is, and a cost that grows with c at fixed counts is least at the smallest size that packs into n
    chunks; those sizes are found by bisection, one per count (a few hundred packings for gpt_10b).
    A grid of 64 sizes had left gpt_small's chunks 7.1% padding where 2.6% is possible."""
    sizes = [k for g in groups for k in g]
    if not sizes:
        return ALIGN
    lo = math.ceil(max(sizes) / ALIGN) * ALIGN
    hi = 4 * lo if hi is None else max(lo, min(4 * lo, hi // ALIGN * ALIGN))
    total = sum(sizes)

    def count(c: int) -> int:
        return sum(pack_sizes(g, c) for g in groups if g)

    if cost is None:
        def cost(counts: list[int], c: int) -> int:
            return sum(counts) * c - total

    best, best_waste = lo, None
    c = lo
    while c <= hi:
        n = count(c)
        waste = cost([pack_sizes(g, c) if g else 0 for g in groups], c)
        if best_waste is None or waste < best_waste:
            best, best_waste = c, waste
        a, b = c // ALIGN + 1, hi // ALIGN + 1  # the smallest aligned size with fewer than n chunks, in [a, b)
        while a < b:
            mid = (a + b) // 2
            if count(mid * ALIGN) < n:
                b = mid
            else:
                a = mid + 1
        c = a * ALIGN
    return best


class ChunkManager:
    def __init__(self, device: torch.device, tracker, dtype: torch.dtype, chunk_size: int, device_budget: int,
                 warmup_budget: int, static: bool, tracer: MemTracer, reuse: bool = False):
        self.device, self.tracker, self.dtype, self.chunk_size = device, tracker, dtype, chunk_size
        self.reuse = reuse  # gradients written over their parameters in the payload (chunk.py), no companion
        self.device_budget, self.warmup_budget, self.static, self.tracer = device_budget, warmup_budget, static, tracer
        self.chunks: list[Chunk] = []
        self.infos: dict[int, TensorInfo] = {}
        self.os_device_bytes = 0  # optimizer chunk bytes on the device (set by ChunkAdam)
        self.phase = "idle"  # fwd | bwd | eval | io | idle
        self.clock = 0
        self._last_use: dict[int, int] = {}
        # statistics (cumulative, and per step for step_metrics)
        self.evictions = self.fetches = 0
        self.peak_device_bytes = 0
        self._moments = 0
        self._device_chunk_sum = 0
        self.comm = None  # ChunkComm with 2+ ranks (set before pack)
        # per warm-up moment: the chunk bytes it cannot do without on the device (``hard_need``)
        self._must: list[int] = []

    # ---- layout -------------------------------------------------------------------------------
    def pack(self, named: list[tuple[str, torch.nn.Parameter, tuple[int, ...], list[str]]], kinds: set[int] = frozenset()) -> None:
        """Place parameters (name, param, shape, aliases) into chunks in order. A chunk holds trainable or
        frozen tensors, and tensors of one kind: the parameters whose id is in ``kinds`` (MoE experts)
        get chunks of their own, so an expert chunk never carries dense parameters."""
        open_chunk: dict[tuple[bool, bool], Chunk | None] = {}
        for name, p, shape, aliases in named:
            info = TensorInfo(name, p, tuple(shape), aliases=list(aliases))
            if info.numel > self.chunk_size:
                raise ValueError(f"parameter {name} has {info.numel} elements, more than strategy.chunk.chunk_size="
                                 f"{self.chunk_size}: a tensor must fit in one chunk (raise chunk_size or set it to "
                                 "null to search one)")
            tr = p.requires_grad
            key = (tr, id(p) in kinds)
            c = open_chunk.get(key)
            if c is None or not c.fits(info.numel):
                c = Chunk(len(self.chunks), "param", self.chunk_size, self.dtype, self.device, self.tracker,
                          trainable=tr, with_grad=tr)
                c.expert = key[1]
                self.chunks.append(c)
                open_chunk[key] = c
            c.add(info)
            self.infos[id(p)] = info
        if self.comm is not None:
            self.comm.assign(self)

    @property
    def local_chunks(self) -> list[Chunk]:
        """Chunks this rank owns (all of them on one rank)."""
        return [c for c in self.chunks if c.local]

    def info(self, p: torch.nn.Parameter) -> TensorInfo:
        return self.infos[id(p)]

    @property
    def grad_factor(self) -> int:
        """Payloads a trainable chunk occupies while its gradient exists: 1 under reuse, 2 with a companion."""
        return 1 if self.reuse else 2

    def state_bytes(self, c: Chunk) -> int:
        """The most bytes chunk ``c`` holds in a step (its payload, and its gradient companion if any)."""
        return c.payload_bytes * (self.grad_factor if c.trainable else 1)

    @property
    def trainable_chunks(self) -> list[Chunk]:
        """Trainable chunks this rank owns (the ones it keeps optimizer states for)."""
        return [c for c in self.chunks if c.trainable and c.local]

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Param/grad chunk bytes on the device (optimizer chunks: ``os_device_bytes``)."""
        return sum(c.nbytes for c in self.chunks if c.where == DEVICE)

    def budget(self, pos: int | None) -> int:
        if self.static or self.tracer.warmup:
            return self.warmup_budget
        return self.device_budget - self.tracer.nonmodel_at(pos) - self.os_device_bytes

    def _note_peak(self) -> None:
        b = self.device_bytes + self.os_device_bytes
        if b > self.peak_device_bytes:
            self.peak_device_bytes = b

    # ---- moments ------------------------------------------------------------------------------
    def access(self, infos: list[TensorInfo], key: tuple[str, str]) -> None:
        """Tensors enter COMPUTE: their chunks are pinned and brought to the device."""
        for t in infos:
            t.users += 1
            t.state = TensorState.COMPUTE
        chunks = list(dict.fromkeys(t.chunk for t in infos))
        if self.comm is None:
            self.ensure(chunks, key)
        else:
            self.gather([c.unit for c in chunks], key, chunks)

    def gather(self, units, key: tuple[str, str], chunks: list[Chunk] = ()) -> None:
        """Make ``chunks`` and every chunk of the units that are not gathered resident, then gather those."""
        todo = [u for u in dict.fromkeys(units) if not u.gathered]
        self.ensure(list(dict.fromkeys([*chunks, *(c for u in todo for c in u.chunks)])), key)
        for u in todo:
            self.comm.gather(u)

    def release(self, infos: list[TensorInfo], state: TensorState) -> None:
        for t in infos:
            t.users = max(0, t.users - 1)
            if t.users == 0:
                t.state = state
        if self.comm is not None:
            for u in dict.fromkeys(t.chunk.unit for t in infos):
                if u.gathered and self._done_with(u):
                    self.comm.release(u)

    def _done_with(self, u) -> bool:
        """A forward is past every tensor of the unit (or a backward past every tensor of a frozen one)."""
        if self.phase in ("fwd", "eval"):
            want = TensorState.HOLD_AFTER_FWD
        elif self.phase == "bwd" and not u.trainable:
            want = TensorState.HOLD_AFTER_BWD
        else:
            return False
        return all(t.state is want for t in u.tensors)

    def take_grad(self, info: TensorInfo, g: torch.Tensor) -> None:
        """``info``'s gradient ``g`` (finished by autograd) into its chunk, which is resident: over the
        parameter's own slice of the payload (reuse), or added into the companion."""
        c = info.chunk
        if self.reuse:
            c.write_grad(info, g)
        else:
            c.alloc_grad()
            c.grad_view(info).add_(g)

    def grad_arrived(self, info: TensorInfo) -> None:
        """``info``'s gradient is in its chunk: reduce its unit once it is complete."""
        info.grad_ready = True
        if self.comm is None:
            return
        u = info.chunk.unit
        if all(t.grad_ready for t in u.tensors):
            self.reduce(u)

    def reduce(self, u) -> None:
        missing = 0 if self.reuse else sum(c.payload_bytes for c in u.chunks if not c.has_grad)
        self.ensure(u.chunks, ("reduce", repr(u)), extra=missing)
        for c in u.chunks:
            c.seal_grads() if self.reuse else c.alloc_grad()
        self.comm.reduce(u)

    def ensure(self, chunks: list[Chunk], key: tuple[str, str], extra: int = 0) -> None:
        """Make every chunk in ``chunks`` resident (plus ``extra`` bytes for a gradient companion),
        evicting others to stay within the moment's budget."""
        # "io" (checkpoint gather, res_check) is never traced; an evaluation is not part of the warm-up trace
        record = self.phase != "io" and (self.phase != "eval" or not self.tracer.warmup)
        pos = self.tracer.moment(key, tuple(c.index for c in chunks)) if record else self.tracer.pos
        self.clock += 1
        for c in chunks:
            self._last_use[c.index] = self.clock
        need = sum(c.payload_bytes * (2 if c.has_grad else 1) for c in chunks if c.where != DEVICE) + extra
        budget = self.budget(pos)
        if self.device_bytes + need > budget:
            self._evict(need - (budget - self.device_bytes), set(id(c) for c in chunks), pos)
        if self.device_bytes + need > budget:
            self._oom(chunks, key, pos, need, budget, extra)
        for c in chunks:
            if c.where != DEVICE:
                if c.where is None:
                    c.allocate(DEVICE, zero=c.local)  # a remote payload is filled by its gather
                else:
                    c.move(DEVICE)
                self.fetches += 1
        if record and self.tracer.warmup:
            keep = set(map(id, chunks))
            # the step moment holds one fp32 gradient chunk where a device-side group is updated
            held = max(extra, 4 * self.chunk_size) if key == ("step", "adam") else extra
            self._must.append(sum(c.nbytes for c in self.chunks if c.where == DEVICE and (id(c) in keep or c.pinned)) + held)
        self._moments += 1
        self._device_chunk_sum += sum(c.where == DEVICE for c in self.chunks)
        self._note_peak()

    def _evict(self, amount: int, keep: set[int], pos: int | None) -> None:
        freed = 0
        if self.comm is not None:  # cached remote buffers go first, oldest first
            for u in list(self.comm.cache):
                for c in u.chunks:
                    if freed < amount and c.cached and id(c) not in keep:
                        freed += c.nbytes
                        self.comm.drop_chunk(c)
        cands = [c for c in self.chunks if c.where == DEVICE and not c.pinned and not c.cached and id(c) not in keep]
        if self.tracer.warmup:
            cands.sort(key=lambda c: self._last_use.get(c.index, 0))  # LRU
        else:
            cands.sort(key=lambda c: -self.tracer.next_use(c.index, pos))  # Belady: farthest next use first
        for c in cands:
            if freed >= amount:
                break
            freed += c.nbytes
            c.move(HOST)
            self.evictions += 1

    def hard_need(self) -> int:
        """After warm-up: the most device bytes a moment of the trace needs besides optimizer chunks, with
        every chunk it does not compute with evicted: its non-model memory plus the chunks it gathers,
        computes with or keeps pinned (and a gradient companion it allocates, or the step's fp32 chunk).
        A moment the trace does not know (an evaluation) is budgeted at the non-model peak, so that peak
        plus the largest unit counts too. ``D - hard_need()`` is the most optimizer bytes the device can
        keep without a moment running out (``ChunkAdam.place_on_device``)."""
        nm = self.tracer.nonmodel
        need = max((a + b for a, b in zip(nm, self._must)), default=0)
        units = [u.chunks for u in self.comm.units] if self.comm is not None else [[c] for c in self.chunks]
        unit = max((sum(c.payload_bytes for c in u) for u in units), default=0)
        return max(need, self.tracer.max_nonmodel + unit)

    def make_room(self, limit: int) -> None:
        """Evict (in the current order) until param chunk bytes on the device are <= ``limit``."""
        if self.device_bytes > limit:
            self._evict(self.device_bytes - limit, set(), self.tracer.pos)

    def _oom(self, chunks, key, pos, need, budget, extra: int = 0) -> None:
        pinned = [c for c in self.chunks if c.where == DEVICE and c.pinned and c not in chunks]
        pinned_b = sum(c.nbytes for c in pinned)
        mine = sum(c.payload_bytes * (2 if c.has_grad else 1) for c in chunks) + extra  # with a gradient being made
        fixes = []  # (field, value) pairs that make this moment fit, cheapest first (the planner's search applies them)
        phase, name = key
        what = {"reduce": "gradient reduction of", "fwd": "forward of", "bwd": "backward of", "rec": "recomputation (ckpt) of", "grad": "gradient of",
                "eval": "evaluation forward of"}.get(phase, phase)
        if self.static or self.tracer.warmup:
            how = (f"the {'static partition' if self.static else 'warm-up'} chunk budget W = "
                   f"warmup_gpu_chunk_mem_ratio x device budget = {_mb(budget)}")
            at_least = math.ceil(100 * (mine + pinned_b) / max(1, self.device_budget)) / 100  # what this moment holds at once
            fix = (f"raise strategy.chunk.warmup_gpu_chunk_mem_ratio (to at least {at_least:.2f} for this moment) or "
                   "strategy.chunk.device_budget_gb, or lower strategy.chunk.chunk_size")
            if self.comm is not None and not self.comm.mem_saving and len(chunks) > 1:
                fix += (f", or set strategy.chunk.mem_saving_comm=true (its {len(chunks)} chunks are gathered together "
                        "by one all-gather; with it, one broadcast per chunk)")
                fixes.append((("strategy.chunk.mem_saving_comm", True),))
            if not self.static and at_least <= 1:
                fixes.append((("strategy.chunk.warmup_gpu_chunk_mem_ratio", float(f"{at_least:.2f}")),))
        else:
            nm = self.tracer.nonmodel_at(pos)
            how = (f"the chunk budget {_mb(budget)} = device budget {_mb(self.device_budget)} - non-model memory "
                   f"{_mb(nm)} at this moment - optimizer chunks on the device {_mb(self.os_device_bytes)}")
            fix = ("raise strategy.chunk.device_budget_gb, lower strategy.chunk.chunk_size, shrink activations "
                   "(+strategy=ckpt, act_offload, a smaller micro-batch) or keep fewer optimizer chunks on the device")
        where = f"moment {pos} of {self.tracer.period}" if pos is not None and not self.tracer.warmup else (
            f"warm-up moment {pos}" if pos is not None else "an untraced moment")
        err = ChunkOutOfMemoryError(
            f"chunk engine out of memory at the {what} {name} ({where}): it needs {_mb(mine)} of chunks "
            f"{[c.index for c in chunks]} on the device{f' (of which {_mb(extra)} for their gradient)' if extra else ''}"
            f" while {_mb(pinned_b)} are pinned by modules computing now, but {how}; {fix}")
        err.fixes = fixes
        raise err

    # ---- per-step bookkeeping -----------------------------------------------------------------
    def begin_forward(self) -> None:
        for t in self.infos.values():
            t.users, t.state, t.grad_ready = 0, TensorState.HOLD, False
        if self.comm is not None:
            for u in self.comm.units:
                u.reduced = False

    def finish_backward(self) -> None:
        for t in self.infos.values():
            if t.users:
                t.users, t.state = 0, TensorState.HOLD_AFTER_BWD
        if self.reuse and self.comm is None:  # one rank: no reduce seals them
            for c in self.chunks:
                if c.grad_in_payload:
                    c.seal_grads()
        self.settle(reduce=True)

    def settle(self, reduce: bool) -> None:
        """End of a backward (reduce=True) or an evaluation: reduce units with partial gradients
        (a parameter that got none), release every unit still gathered."""
        if self.comm is None:
            return
        for u in self.comm.units:
            if reduce and u.trainable and not u.reduced and any(t.grad_ready for t in u.tensors):
                self.reduce(u)
            elif u.gathered:
                self.comm.release(u)

    def take_step_stats(self) -> dict:
        mean = self._device_chunk_sum / self._moments if self._moments else 0.0
        self._moments = self._device_chunk_sum = 0
        return {"mean_chunks_on_device": mean}
