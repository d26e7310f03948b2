"""Runtime memory tracer (PatrickStar): learn, in a warm-up iteration, how much *non-model* memory
the device holds at every moment and which chunks every moment uses; then serve the per-moment chunk
budget and the next-use distance that eviction needs.

A *moment* is one chunk access: a module's pre-forward, a recomputation's pre-forward (activation
checkpointing), a module's pre-backward, or a gradient's arrival. Its key is (phase, name).

Non-model memory = bytes live on the compute device that are not chunks: activations, batches,
autograd temporaries. It is read from the ``MemoryTracker`` (on CUDA without a tracker, from the
allocator minus the engine's own chunk bytes; on a CPU without a tracker it is unknown and taken as
0). The value kept for moment t is the maximum over [t, t+1): the sample at t, the sample at t+1 and
every value seen in between, so a peak inside a module (the logits and the loss of the LM head, the
weight gradient autograd creates before the grad hook takes it) is charged to the moment that
precedes it. With a tracker, "in between" is exact: during warm-up the tracer sees every allocation
the tracker counts. Without one (CUDA, ``trainer.track_memory=false``), ``async_mem_monitor`` samples
the allocator from a thread every ``monitor_interval_ms`` (PatrickStar's option); without either,
peaks strictly inside a module are missed, as in PatrickStar's synchronous mode.

After warm-up the trace is a cycle (one optimizer step). ``locate`` follows it: the next occurrence
of the key at or after the expected position, wrapping around; keys that never occurred in warm-up
(e.g. an evaluation-only path) get ``None`` and the engine then uses the most conservative budget.
"""
from __future__ import annotations

import bisect
import threading
import weakref

import torch


class MemTracer:
    def __init__(self, device: torch.device, tracker, device_chunk_bytes=None, async_monitor: bool = False,
                 interval_ms: float = 1.0):
        self.device, self.tracker = device, tracker
        self._chunk_bytes = device_chunk_bytes or (lambda: 0)
        self.warmup = True
        self.keys: list[tuple[str, str]] = []
        self.chunks: list[tuple[int, ...]] = []
        self.nonmodel: list[int] = []
        self.pos: int | None = None
        self._where: dict[tuple, list[int]] = {}
        self._uses: dict[int, list[int]] = {}
        self._interval_max = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._hooked = False
        if tracker.enabled:
            self._hook_tracker()
        if async_monitor:
            self._thread = threading.Thread(target=_monitor, args=(weakref.ref(self), interval_ms / 1000.0, self._stop),
                                            name="memopt-chunk-mem-monitor", daemon=True)
            self._thread.start()

    def _hook_tracker(self) -> None:
        """Warm-up only: see every allocation the tracker counts, so that the non-model peak
        between two moments is exact (an instance attribute shadows the tracker's method; removed
        by ``end_warmup``)."""
        tracker, ref = self.tracker, weakref.ref(self)
        orig = tracker._update_peak
        key = tracker.compute_key

        def update_peak(device, _orig=orig) -> int:
            total = _orig(device)
            me = ref()
            if me is not None and device == key:
                live = tracker.live[device]
                me._observe(sum(live.values()) - live.get("chunks", 0))
            return total  # the budget check reads it

        tracker._update_peak = update_peak
        self._hooked = True

    def _unhook_tracker(self) -> None:
        if self._hooked:
            self.tracker.__dict__.pop("_update_peak", None)
            self._hooked = False

    # ---- sampling -----------------------------------------------------------------------------
    def sample(self) -> int:
        """Non-model bytes on the compute device now."""
        t = self.tracker
        if t.enabled:
            with t._lock:
                live = dict(t.live.get(t.compute_key, {}))
            return max(0, sum(b for c, b in live.items() if c != "chunks"))
        if self.device.type == "cuda":
            return max(0, torch.cuda.memory_allocated(self.device) - self._chunk_bytes())
        return 0

    def _take_interval_max(self) -> int:
        with self._lock:
            m, self._interval_max = self._interval_max, 0
        return m

    def _observe(self, value: int) -> None:
        with self._lock:
            if value > self._interval_max:
                self._interval_max = value

    # ---- moments ------------------------------------------------------------------------------
    def moment(self, key: tuple[str, str], chunk_ids: tuple[int, ...]) -> int | None:
        """Record (warm-up) or locate (afterwards) a moment; returns its trace position."""
        if self.warmup:
            now = self.sample()
            between = self._take_interval_max()
            if self.nonmodel:
                self.nonmodel[-1] = max(self.nonmodel[-1], now, between)
            self.keys.append(key)
            self.chunks.append(tuple(chunk_ids))
            self.nonmodel.append(now)
            self.pos = len(self.keys) - 1
            return self.pos
        self.pos = self.locate(key)
        return self.pos

    def end_warmup(self) -> None:
        """Close the trace (call after the first optimizer step) and index it."""
        if not self.warmup:
            return
        now, between = self.sample(), self._take_interval_max()
        if self.nonmodel:
            self.nonmodel[-1] = max(self.nonmodel[-1], now, between)
        self.warmup = False
        self._stop.set()
        self._unhook_tracker()
        for i, (k, cs) in enumerate(zip(self.keys, self.chunks)):
            self._where.setdefault(k, []).append(i)
            for c in cs:
                self._uses.setdefault(c, []).append(i)
        self.pos = None

    def close(self) -> None:
        self._stop.set()
        self._unhook_tracker()

    @property
    def period(self) -> int:
        return len(self.keys)

    def locate(self, key: tuple[str, str]) -> int | None:
        where = self._where.get(key)
        if not where:
            return None
        start = 0 if self.pos is None else self.pos + 1
        i = bisect.bisect_left(where, start)
        return where[i] if i < len(where) else where[0]

    def nonmodel_at(self, pos: int | None) -> int:
        if not self.nonmodel:
            return 0
        return max(self.nonmodel) if pos is None else self.nonmodel[pos]

    @property
    def max_nonmodel(self) -> int:
        return max(self.nonmodel) if self.nonmodel else 0

    def next_use(self, chunk_id: int, pos: int | None) -> float:
        """Trace distance from ``pos`` to the chunk's next use (Belady's key); inf if never used."""
        uses = self._uses.get(chunk_id)
        if not uses:
            return float("inf")
        p = -1 if pos is None else pos
        i = bisect.bisect_right(uses, p)
        nxt = uses[i] if i < len(uses) else uses[0] + self.period
        return nxt - p


def _monitor(ref, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        tracer = ref()
        if tracer is None:
            return
        try:
            tracer._observe(tracer.sample())
        except Exception:  # a sample racing interpreter shutdown must not kill anything
            return
        del tracer
