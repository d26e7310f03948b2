"""The chunk engine at the planned depth, without running the blocks: a shallow step recorded, stretched, replayed.

Why: the chunk engine deals chunks to ranks in groups of W, so a rank's chunk layout (how many chunks
it owns, which are padding, how many optimizer groups it updates) is a step function of depth, and
with large chunks (gpt_10b on 8 ranks: 3.7 blocks per chunk, a group every ~30 blocks) no shallow
model has the planned model's layout; affine extrapolation (``extrapolate.py``) cannot be exact
there. What does not depend on the layout is the model's side of a step: the bytes the blocks'
operations allocate and free, their FLOPs, and the order in which they call the engine (the
manager's ``access`` / ``release``, a gradient's arrival, phase changes). That side is the same for
every middle block.

So one training step of a shallow model (``n`` blocks, the planned chunk size) is *recorded*: every
change the model's operations make to the memory tracker (bytes per memory and category, in order),
their FLOPs and link traffic, the tracker contexts they open, and every call they make into the
chunk manager, by tensor and module name. Middle block ``m``'s part of each pass (forward,
backward with its recomputation, evaluation; m = n - 3, since block 1 differs from later ones in an
evaluation under checkpointing) must equal block ``m + 1``'s with the names shifted (checked, else
the plan says why and takes the other ways). The recording is then
*stretched* to N blocks (block ``m``'s part repeated, later blocks renamed) and *replayed* in
``simulate_rank`` at depth N: the engine is the real one, built at depth N with the planned layout
(chunk packing, ownership, padding, the optimizer's groups, Hybrid Adam's placement, the eviction
budget and the warm-up tracer all run for real on fake tensors), and the recorded model side is
applied to the same tracker in the same order instead of running the blocks. The optimizer step,
the evaluation's engine calls and the checkpoint's state dict are the engine's own code as well.

Exactness rests on two facts that are checked, not assumed: the model side of a block does not
depend on the layout (the recorded calls carry names, never chunks; a model tensor freed inside the
engine other than a gradient the engine takes, or an engine tensor freed by the model, stops the
recording), and middle blocks repeat (the template check). ``extrapolate.simulate`` further checks
the stretch on the first simulated rank: the recording of n blocks stretched to n + 1 must equal the
recording of n + 1 blocks item for item; the other planned rank replays that rank's recording (the
model side is every rank's: the engine's hooks run in the same order on every rank). Tensors the model makes in one step and frees outside it
(the loss the caller drops) are freed at the end of their step, where the caller drops them.

Measured (tests/planner/test_chunk_replay.py): byte-identical peaks, FLOPs, traffic, collectives and
engine metrics to the block-by-block simulation, with and without checkpointing, evaluation, the
state dict, mem_saving_comm, gradient accumulation and a device budget that evicts; gpt_10b on 8
ranks (the README's plan): the same plan.json, planned in 23.9 s instead of 71.0 s (load 3.4-5). What the replay still costs is the
engine's own work at depth N on fake tensors (building and binding every chunk, a gradient's add
into its chunk per parameter, every gather): ~25k fake ops for gpt_10b, against ~3x that for the
blocks. Most of them are views, in-place updates and allocations, which the planner answers without
FakeTensorMode's dispatch (``fast_ops.py``), and the next rank replays the stretch the first one made
(``depth.replayed``): the same plan.json in about 30% less CPU time.
"""
from __future__ import annotations

import contextlib
import re
from collections import defaultdict

from memopt.planner.engines.base import NotReplayed

BLOCK = re.compile(r"^blocks\.(\d+)\.")


class Unsupported(NotReplayed):
    """The recording cannot be replayed (the reason says why)."""


def _rename(name: str, f) -> str:
    m = BLOCK.match(name)
    return name if m is None else f"blocks.{f(int(m.group(1)))}.{name[m.end():]}"


def _names(item) -> list[str]:
    """Tensor and module names an item refers to (their block indices place it)."""
    kind = item[0]
    if kind == "call":
        what, args = item[1], item[2]
        if what == "access":
            return [*args[0], args[1][1]]
        if what == "release":
            return list(args[0])
        if what == "grad":
            return [args[0]]
        return []
    if kind == "g":
        return [item[1]]
    return []


def _map_item(item, f):
    """``item`` with block index i renamed f(i)."""
    kind = item[0]
    if kind == "call":
        what, args = item[1], item[2]
        if what == "access":
            return ("call", what, ([_rename(n, f) for n in args[0]], (args[1][0], _rename(args[1][1], f))))
        if what == "release":
            return ("call", what, ([_rename(n, f) for n in args[0]], args[1]))
        if what == "grad":
            return ("call", what, (_rename(args[0], f),))
        return item
    if kind == "g":
        return ("g", _rename(item[1], f), *item[2:])
    return item


def _blocks(item) -> set[int]:
    return {int(m.group(1)) for n in _names(item) if (m := BLOCK.match(n))}


class Recorder:
    """Records the model side of the chunk engine's ``forward_backward`` and ``eval_loss`` calls."""

    def __init__(self):
        self.streams: list[tuple[str, list]] = []  # (kind, items) per call, in call order
        self.active = False
        self.depth = 0  # > 0: inside a call into the engine
        self.cls: dict[int, tuple[str, int, int] | str] = {}  # storage key -> ("model", stream, item) | "engine"
        self.grad_keys: set[int] = set()
        self.why: str | None = None
        self._traffic = None

    # ---- stream plumbing ----------------------------------------------------------------------
    def _emit(self, item) -> int:
        items = self.streams[-1][1]
        items.append(item)
        return len(items) - 1

    def _fail(self, why: str) -> None:
        if self.why is None:
            self.why = why

    def _traffic_now(self):
        t = self.tracker
        return dict(t.traffic), {k: dict(v) for k, v in t.comm_ops.items()}

    def _flush_traffic(self) -> None:
        """The model's FLOPs and traffic since the last engine call, as one item."""
        (tr0, ops0), (tr1, ops1) = self._traffic, self._traffic_now()
        dt = {k: v - tr0.get(k, 0) for k, v in tr1.items() if v != tr0.get(k, 0)}
        dops = {}
        for k, rec in ops1.items():
            d = {f: v - ops0.get(k, {}).get(f, 0) for f, v in rec.items()}
            if any(d.values()):
                dops[k] = d
        if dt or dops:
            self._emit(("t", dt, dops))
        self._traffic = (tr1, ops1)

    # ---- patches ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attached(self):
        """Record the engines ``memopt.engines.build_engine`` builds while the block runs."""
        from memopt import engines

        orig = engines.build_engine

        def build(cfg, device, dims, tracker):
            engine = orig(cfg, device, dims, tracker)
            self._attach(engine)
            return engine

        engines.build_engine = build
        try:
            yield self
        finally:
            engines.build_engine = orig

    def _call(self, what: str, fn, args_for_record):
        def wrapper(*args, **kwargs):
            if not self.active or self.depth:
                return fn(*args, **kwargs)
            self._flush_traffic()
            self._emit(("call", what, args_for_record(*args, **kwargs)))
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self._traffic = self._traffic_now()
                for it in self._deferred:
                    self._emit(it)
                self._deferred = []

        return wrapper

    def _attach(self, engine) -> None:
        from memopt.engines.chunk.engine import ChunkEngine

        if not isinstance(engine, ChunkEngine):
            raise Unsupported(f"not the chunk engine ({type(engine).__name__})")
        self.tracker, mgr, hooks = engine.tracker, engine.mgr, engine.hooks
        self._deferred: list = []
        names = lambda infos: [i.name for i in infos]  # noqa: E731
        mgr.access = self._call("access", mgr.access, lambda infos, key: (names(infos), tuple(key)))
        mgr.release = self._call("release", mgr.release, lambda infos, state: (names(infos), state))
        mgr.begin_forward = self._call("begin_forward", mgr.begin_forward, lambda: ())
        mgr.finish_backward = self._call("finish_backward", mgr.finish_backward, lambda: ())
        mgr.settle = self._call("settle", mgr.settle, lambda reduce: (reduce,))
        on_grad = hooks._on_grad

        def grad(p):  # the engine takes p.grad: its allocation is replayed as a real tensor
            if self.active and not self.depth:
                key = id(p.grad.untyped_storage())
                where = self.cls.get(key)
                nbytes = p.grad.untyped_storage().nbytes()
                if not isinstance(where, tuple) or where[1] != len(self.streams) - 1 or nbytes != p.numel() * p.element_size():
                    self._fail(f"the gradient of {mgr.info(p).name} is not a tensor of its own made in this step")
                else:
                    items = self.streams[-1][1]
                    d = items[where[2]]
                    (dev, cat, b), = d[1]
                    items[where[2]] = ("g", mgr.info(p).name, dev, cat, b)
                    self.grad_keys.add(key)
            return record_grad(p)

        record_grad = self._call("grad", on_grad, lambda p: (mgr.info(p).name,))
        for h, p in _grad_hooks(engine):  # re-register the engine's gradient hooks through the recorder
            h.remove()
            engine.hooks.handles.append(p.register_post_accumulate_grad_hook(grad))
        mgr_cls = type(mgr)
        rec = self

        class Phased(mgr_cls):  # phase changes the model side makes (forward, backward, evaluation)
            @property
            def phase(self):
                return self.__dict__["phase"]

            @phase.setter
            def phase(self, v):
                if rec.active and not rec.depth:
                    rec._emit(("phase", v))
                self.__dict__["phase"] = v

        mgr.__class__ = Phased
        t = self.tracker
        t._track = self._track_patch(t._track)
        t._release = self._release_patch(t._release)
        for ctx in ("retained", "category", "host_scope"):
            setattr(t, ctx, self._ctx_patch(ctx, getattr(t, ctx)))
        for meth in ("forward_backward", "eval_loss"):
            setattr(engine, meth, self._stream(meth, getattr(engine, meth)))

    def _stream(self, kind: str, fn):
        def wrapper(*args, **kwargs):
            self.streams.append((kind, []))
            self.active, self._traffic = True, self._traffic_now()
            try:
                out = fn(*args, **kwargs)
                del out  # the caller drops it at once (simulate_rank): its free belongs to the stream
            finally:
                self._flush_traffic()
                self.active = False

        return wrapper

    def _track_patch(self, orig):
        t = self

        def _track(x, category, device=None, retag=False):
            if not t.active:
                return orig(x, category, device=device, retag=retag)
            try:
                st = x.untyped_storage()
                key = id(st)
            except Exception:
                key = None
            known = key in t.tracker._info
            if known and not retag:  # an op's output on a storage counted already (a view, an in-place op): the tracker
                ref = t.tracker._refs.get(key)  # changes nothing (its own early return), so neither the snapshot nor the diff
                if ref is not None and ref() is st:
                    return orig(x, category, device=device, retag=retag)
            before = _snapshot(t.tracker.live)
            orig(x, category, device=device, retag=retag)
            d = _diff(before, t.tracker.live)
            if not d:
                return
            info = t.tracker._info.get(key)
            if not known and info is not None:  # a new storage
                if t.depth:
                    t.cls[key] = "engine"
                else:
                    t.cls[key] = ("model", len(t.streams) - 1, t._emit(("d", d, info.device)))
            elif t.cls.get(key) is not None and isinstance(t.cls[key], tuple) and not t.depth:
                t._emit(("d", d, info.device if info is not None else None))
            elif t.depth == 0:
                t._fail("the model re-tagged a tensor it did not make in this step")

        return _track

    def _release_patch(self, orig):
        t = self

        def _release(key):
            if not t.active:
                t.cls.pop(key, None)
                return orig(key)
            before = _snapshot(t.tracker.live)
            orig(key)
            d = _diff(before, t.tracker.live)
            where = t.cls.pop(key, None)
            if key in t.grad_keys:
                t.grad_keys.discard(key)
                return
            if isinstance(where, tuple):
                if t.depth:
                    t._fail("the chunk engine freed a tensor of the model's")
                elif d:
                    t._emit(("d", d, None))
            elif where == "engine" and not t.depth and d:
                t._fail("the model freed a tensor of the chunk engine's")
            elif where is None and not t.depth and d:
                t._fail("the model freed a tensor made before its step")

        return _release

    def _ctx_patch(self, name: str, orig):
        t = self

        @contextlib.contextmanager
        def ctx(*args, **kwargs):
            if kwargs:
                t._fail(f"tracker.{name} called with keywords")
            if not t.active or t.depth:
                with orig(*args):
                    yield
                return
            t._emit(("enter", name, args))
            cm = orig(*args)
            cm.__enter__()
            try:
                yield
            finally:
                if name == "retained":
                    keys = list(dict.fromkeys(t.tracker._captures[-1]))  # an id can be captured twice (a freed storage's reused)
                    pre = {k: t.tracker._info[k].category for k in keys if k in t.tracker._info}
                cm.__exit__(None, None, None)
                if name == "retained":
                    to = args[0] if args else "activations"
                    transient = args[1] if len(args) > 1 else "_forward"
                    moved = []
                    for k in keys:
                        info = t.tracker._info.get(k)
                        if pre.get(k) == transient and info is not None and info.category == to and isinstance(t.cls.get(k), tuple):
                            moved.append((t.cls[k][1], t.cls[k][2], info.device, info.nbytes))
                    t._emit(("retag", transient, to, sorted(moved)))  # capture order follows storage reuse, which the GC times
                t._emit(("exit",))

        return ctx


def _grad_hooks(engine):
    """(handle, parameter) of the engine's post-accumulate-grad hooks (ChunkHooks registers them last)."""
    out = []
    infos = [i for i in engine.mgr.infos.values() if i.param.requires_grad]
    hs = engine.hooks.handles[-len(infos):] if infos else []
    for h, info in zip(hs, infos):
        out.append((h, info.param))
    return out


def _snapshot(live) -> dict:
    return {d: dict(c) for d, c in live.items()}


def _diff(a: dict, b) -> tuple:
    out = []
    for d, cats in b.items():
        for c, v in cats.items():
            x = v - a.get(d, {}).get(c, 0)
            if x:
                out.append((d, c, x))
    return tuple(out)


# ---- stretching --------------------------------------------------------------------------------
def _passes(items: list) -> list[tuple[int, int, int]]:
    """(start, end, direction) of the forward (+1), backward (-1) and evaluation (+1) passes."""
    out, start, dirn = [], None, 0
    for i, it in enumerate(items):
        if it[0] == "phase":
            if start is not None:
                out.append((start, i, dirn))
            start, dirn = (i + 1, {"fwd": 1, "eval": 1, "bwd": -1}.get(it[1], 0)) if it[1] in ("fwd", "eval", "bwd") else (None, 0)
    return out


def _cut(items, start, end, prev, j):
    """Where block ``j``'s part of a pass begins: in the gap between the last item naming ``prev`` (the
    block before it in the pass) and the first naming ``j``, the first place with the fewest tracker
    contexts open (a checkpoint segment's context opens before its block's first call)."""
    a = next((i for i in range(start, end) if j in _blocks(items[i])), None)
    if a is None:
        return None
    p = max((i for i in range(start, a) if prev in _blocks(items[i])), default=None)
    if p is None or any(prev in _blocks(items[i]) for i in range(a, end)):
        return None
    best, depth, low = p + 1, 0, 0
    for i in range(p + 1, a):
        depth += (items[i][0] == "enter") - (items[i][0] == "exit")
        if depth < low:
            best, low = i + 1, depth
    return best


def _region(items, start, end, j, dirn):
    """Block j's part of a pass: [its cut, the next block's cut)."""
    a, b = _cut(items, start, end, j - dirn, j), _cut(items, start, end, j, j + dirn)
    return (a, b) if a is not None and b is not None else None


def _relative(items, lo, hi, j):
    return [_map_item(it, lambda i: i - j) for it in items[lo:hi]]


def stretch(streams: list, n: int, N: int, m: int | None = None) -> list:
    """The recorded streams of an n-block model for N blocks: block m's part of each pass (default
    n - 3) repeated N - n + 1 times, later blocks renumbered. Raises ``Unsupported`` when block m's
    part differs from block m + 1's. Block 1 is not one of them: in an evaluation under checkpointing
    it frees the embedding's output, later blocks their predecessor's (another category)."""
    m = n - 3 if m is None else m
    if not (0 < m and m + 2 <= n - 1):
        raise Unsupported(f"{n} recorded blocks have no two middle blocks followed by a third")
    k = N - n + 1
    regions = {}
    for s, (_kind, items) in enumerate(streams):
        regions[s] = []
        for start, end, dirn in _passes(items):
            if dirn == 0:
                continue
            r, r2 = _region(items, start, end, m, dirn), _region(items, start, end, m + 1, dirn)
            if r is None:
                continue
            if r2 is None:
                raise Unsupported(f"block {m + 1} has no part of its own in a pass")
            mine, ref = _relative(items, *r, m), _relative(items, *r2, m + 1)
            if _template(mine) != _template(ref):
                raise Unsupported(f"blocks {m} and {m + 1} differ in a {'forward' if dirn == 1 else 'backward'} pass "
                                  f"({len(mine)} and {len(ref)} recorded events)")
            depth = 0
            for it in items[r[0]:r[1]]:
                depth += (it[0] == "enter") - (it[0] == "exit")
                if depth < 0:
                    raise Unsupported("a tracker context spans two blocks")
            if depth:
                raise Unsupported("a tracker context spans two blocks")
            regions[s].append((r[0], r[1], dirn))
    shift = lambda i: i if i < m else i + N - n  # noqa: E731  (i == m only inside the repeated part)
    out = []
    for s, (kind, items) in enumerate(streams):
        new, i = [], 0
        regs = sorted(regions[s])
        for lo, hi, dirn in [*regs, (len(items), len(items), 0)]:
            for it in items[i:lo]:
                if m in _blocks(it):
                    raise Unsupported(f"block {m} is named outside its own part")
                new.append(_resolve(_map_item(it, shift), streams, regions, k, s, None))
            if hi > lo:
                tmpl = _relative(items, lo, hi, m)
                order = range(k) if dirn == 1 else range(k - 1, -1, -1)
                for r in order:
                    for it in tmpl:
                        new.append(_resolve(_map_item(it, lambda i, r=r: i + m + r), streams, regions, k, s, (lo, hi)))
            i = hi
        out.append((kind, new))
    return out


def _template(items: list) -> list:
    """Items compared across blocks: retags by their bytes, not by where the tensors were made."""
    out = []
    for it in items:
        if it[0] == "retag":
            out.append(("retag", it[1], it[2], sorted((d, b) for _s, _i, d, b in it[3])))
        else:
            out.append(it)
    return out


def _resolve(item, streams, regions, k, s, inside):
    """A retag's bytes at depth N: tensors made in a repeated part count once per repetition, unless
    the retag itself is in that part (a recomputation's own tensors)."""
    if item[0] != "retag":
        return item
    by_dev: dict[str, int] = defaultdict(int)
    for st, idx, dev, b in item[3]:
        rep = any(lo <= idx < hi for lo, hi, _d in regions.get(st, ()))
        if inside is not None:
            if st != s or not (inside[0] <= idx < inside[1]):
                raise Unsupported("a recomputation keeps tensors made outside its block")
            by_dev[dev] += b
        else:
            by_dev[dev] += b * (k if rep else 1)
    return ("retag_bytes", item[1], item[2], dict(by_dev))


# ---- replay -------------------------------------------------------------------------------------
@contextlib.contextmanager
def replaying(streams: list):
    """``simulate_rank`` inside this block plays ``streams`` (stretched) instead of running the model."""
    from memopt import engines

    orig = engines.build_engine
    queue = list(streams)

    def build(cfg, device, dims, tracker):
        engine = orig(cfg, device, dims, tracker)
        player = _Player(engine, queue)
        engine.forward_backward = lambda *a, **kw: player.play("forward_backward")
        engine.eval_loss = lambda *a, **kw: player.play("eval_loss")
        return engine

    engines.build_engine = build
    try:
        yield
    finally:
        engines.build_engine = orig


class _Player:
    def __init__(self, engine, queue: list):
        import torch

        self.engine, self.queue, self.torch = engine, queue, torch  # noqa
        mgr = engine.mgr
        self.infos = {}
        for info in mgr.infos.values():
            for n in (info.name, *info.aliases):
                self.infos[n] = info
        self.pending: dict[str, object] = {}

    def play(self, kind: str):
        from torch.utils._python_dispatch import _disable_current_modes as no_modes

        torch, eng = self.torch, self.engine
        if not self.queue or self.queue[0][0] != kind:
            raise Unsupported(f"the planned run calls {kind} where the recording has {self.queue[0][0] if self.queue else 'nothing'}")
        _kind, items = self.queue.pop(0)
        t, mgr = eng.tracker, eng.mgr
        stack = []
        for it in items:
            op = it[0]
            if op == "d":
                for dev, cat, b in it[1]:
                    t.live[dev][cat] += b
                if it[2] is not None:
                    t._update_peak(it[2])
            elif op == "call":
                what, args = it[1], it[2]
                if what == "access":
                    mgr.access([self.infos[n] for n in args[0]], args[1])
                elif what == "release":
                    mgr.release([self.infos[n] for n in args[0]], args[1])
                elif what == "grad":
                    p = self.infos[args[0]].param
                    with no_modes():  # the setter asks both tensors their device 6 times: ops through the modes, ~50 us each
                        p.grad = self.pending.pop(args[0])
                    eng.hooks._on_grad(p)
                else:
                    getattr(mgr, what)(*args)
            elif op == "g":
                name, dev, cat, _b = it[1:]
                p = self.infos[name].param
                counting, t.counting = t.counting, False  # the recorded model side counted the op that made it
                try:
                    with t.category(cat), (t.host_scope() if dev == "host" else contextlib.nullcontext()):
                        self.pending[name] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                finally:
                    t.counting = counting
            elif op == "phase":
                mgr.phase = it[1]
            elif op == "enter":
                cm = getattr(t, it[1])(*it[2])
                cm.__enter__()
                stack.append(cm)
            elif op == "exit":
                stack.pop().__exit__(None, None, None)
            elif op == "retag_bytes":
                for dev, b in it[3].items():
                    t.live[dev][it[1]] -= b
                    t.live[dev][it[2]] += b
                    t._update_peak(dev)
            elif op == "t":
                if t.counting:
                    for key, v in it[1].items():
                        t.traffic[key] += v
                    for key, rec in it[2].items():
                        for f, v in rec.items():
                            t.comm_ops[key][f] += v
            else:
                raise Unsupported(f"unknown recorded item {op}")
        if stack:
            raise Unsupported("a tracker context left open")


# ---- the two halves, for extrapolate.py -------------------------------------------------------------
def record(cfg, rank: int, world: int, backend: str) -> tuple[list, dict]:
    """Simulate ``cfg`` (a shallow model) for real, recording its model side; (streams, the simulation)."""
    from memopt.planner.simulate import PlanOverflow, simulate_rank

    rec = Recorder()
    try:
        with rec.attached():
            sim = simulate_rank(cfg, rank, world, None, backend=backend)
    except PlanOverflow as e:
        raise Unsupported(f"the {cfg.model.n_layer}-block model it records does not fit ({e})") from None
    if rec.why is not None:
        raise Unsupported(rec.why)
    return rec.streams, sim


def replay(cfg, stretched: list, rank: int, world: int, limits: dict | None, backend: str) -> dict:
    """``simulate_rank`` of ``cfg`` (N blocks) with a recording stretched to N blocks (``stretch``) in place of the model."""
    from memopt.planner.simulate import simulate_rank

    with replaying(stretched):
        return simulate_rank(cfg, rank, world, limits, backend=backend)
