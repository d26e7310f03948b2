"""Fake ops whose result is known without FakeTensorMode's dispatch: views, in-place updates, ``empty``, and
ops that make new tensors, answered as FakeTensorMode answered them before.

Why: a plan is ~40k ops on fake tensors, each ~0.1-0.5 ms, and most of that time is FakeTensorMode's
generic machinery (a cache key built from every argument, the output rebuilt from the cache entry),
not the op. For these op kinds the output follows from the inputs alone:

* a view (``view``, ``as_strided``, ``slice``, ``select``, ``detach``, ``t``, ``transpose``, ``permute``,
  ``unsqueeze``, ``squeeze``, ``expand``) is the op's meta kernel run on the fake input, which aliases its
  storage, wrapped as a fake tensor on the input's device: what FakeTensorMode itself does, without the cache key;
* an in-place update (``add_``, ``zero_``, ``mul_``, ``div_``, ``copy_``) returns its first argument (FakeTensorMode's
  cache returns exactly that for an in-place op; autograd bumps the version above the dispatch modes);
* ``empty`` (on the CPU, where the planner puts every tensor) is its meta tensor on that device, and so is
  ``randn`` (a fake tensor holds no values; the parameters' initialisation draws one each);
* ``prim.device`` of a fake tensor is its fake device (FakeTensorMode's own handler, reached directly);
* any other aten op that is not a view, mutates nothing and has no data-dependent output (products, sums,
  norms, activations, their backwards, casts, ``cat``, attention) is answered by FakeTensorMode the first time
  for its arguments' metadata (shapes, strides, offsets, dtypes, devices; other arguments by value); where its
  outputs were new tensors of their own storage, later calls with the same metadata get new tensors of the same
  shapes, strides, dtypes and devices (``_recalled``: a key of plain tuples, ~10x cheaper than FakeTensorMode's).

Nothing the planner counts differs: the tracker counts an op's FLOPs, bytes and collectives from the op, its
arguments and its output's metadata around this answer, whichever path made it; a view or an in-place op
makes no storage (the tracker skips its output) and a recalled op's outputs are new storages of the bytes
FakeTensorMode's were; no collective is answered here (not aten ops). Only tensors FakeTensorMode made
itself, holding no propagated constant (a ``.item()`` reads those), on the mode that would run the op, take
this path; anything else falls through to FakeTensorMode. ``run`` returns ``NotImplemented`` then.

Measured (gpt_10b on PatrickStar's 8 ranks, chunk engine): ~11k of rank 0's ~14k ops are answered here,
besides its ~10k device queries; the two ranks' recording and replays took ~40% less CPU time. The recalled
ops (moe_small's ZeRO-3-Offload plan on 2 ranks: ~15k of its ~43k ops): that plan 8.9 s against 9.9 s, a
one-process search 57 s against 68 s. Tested: tests/planner/test_fast_ops.py (op by op against
FakeTensorMode, and a simulated rank with the path on and off); every plan test compares with the
block-by-block simulation.
"""
from __future__ import annotations

import torch

try:
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    _FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
except (ImportError, AttributeError):  # another torch: every op goes through FakeTensorMode
    FakeTensor = None

aten = torch.ops.aten
VIEWS = frozenset({aten.view.default, aten.as_strided.default, aten.slice.Tensor, aten.detach.default,
                   aten.t.default, aten.transpose.int, aten.select.int, aten.unsqueeze.default, aten.expand.default,
                   aten.squeeze.dim, aten.permute.default})
COPY = aten.copy_.default  # an in-place update whose source may be on another device, of another dtype
INPLACE = frozenset({aten.add_.Tensor, aten.zero_.default, aten.mul_.Tensor, aten.div_.Tensor, COPY})
EMPTY = aten.empty.memory_format
# a fresh tensor whose values a fake one has none of: ``empty``'s answer (every parameter's init draws one, seeded by
# a generator: ~2.7 ms each through FakeTensorMode, a quarter of a plan that goes over at its build)
RANDOM = frozenset({aten.randn.default, aten.randn.generator})
enabled = True  # tests turn it off to compare


def _plain_fake(t, mode) -> bool:
    return type(t) is FakeTensor and t.fake_mode is mode and t.constant is None


def device(args):
    """``prim.device`` of a tensor: a fake tensor's own answer (FakeTensorMode's handler, without its dispatch)."""
    x = args[0] if len(args) == 1 else None
    if FakeTensor is not None and enabled and type(x) is FakeTensor and not x.fake_mode.in_kernel_invocation:
        return x.fake_device
    return torch.ops.prim.device.default(*args)


def run(func, args, kwargs):
    """The output of ``func`` on fake tensors, or ``NotImplemented`` (FakeTensorMode runs it)."""
    if FakeTensor is None or not enabled:
        return NotImplemented
    if func in VIEWS:
        x = args[0]
        if kwargs or type(x) is not FakeTensor:
            return NotImplemented
        mode = torch._C._get_dispatch_mode(_FAKE_KEY)
        if mode is None or not _plain_fake(x, mode):
            return NotImplemented
        with in_kernel_invocation_manager(mode):
            out = func(*args)
        return FakeTensor(mode, out, x.fake_device)
    if func in INPLACE:
        mode = torch._C._get_dispatch_mode(_FAKE_KEY)
        if kwargs or mode is None or not all(_plain_fake(a, mode) for a in args if isinstance(a, torch.Tensor)):
            return NotImplemented
        x = args[0]
        if func is not aten.zero_.default and isinstance(args[1], torch.Tensor):
            y = args[1]  # what the kernel would reject: another device (but copy_'s), a shape that does not broadcast into x
            if (func is not COPY and y.fake_device != x.fake_device) or torch.broadcast_shapes(x.shape, y.shape) != x.shape:
                return NotImplemented
        return x
    if func is EMPTY or func in RANDOM:
        mode = torch._C._get_dispatch_mode(_FAKE_KEY)
        kw = dict(kwargs or {})
        if func is not EMPTY:
            kw.pop("generator", None)
            func = EMPTY
        device = torch.device(kw.get("device") or "cpu")
        if mode is None or kw.get("pin_memory") or device.type != "cpu" or len(args) != 1:
            return NotImplemented
        kw["device"] = "meta"
        with in_kernel_invocation_manager(mode):
            out = func(*args, **kw)
        return FakeTensor(mode, out, device)
    return _recalled(func, args, kwargs)


_OUTPUTS: dict = {}  # (op, its arguments' metadata) -> its outputs' (shape, stride, dtype, device) and container
_RECALLABLE: dict = {}  # op -> whether its answers can be recalled (``_recallable``)
_NOT = object()
_KEPT = 100_000  # answers kept at most (a search's plans see a few thousand kinds of op and shape)
_SCALARS = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _part(a, mode):
    """An argument in an op's key: a fake tensor by its metadata, a scalar by value, a list of them; ``_NOT`` for
    anything else (a generator, a process group, a tensor of another kind: FakeTensorMode answers)."""
    if isinstance(a, torch.Tensor):
        if not _plain_fake(a, mode) or a.layout is not torch.strided:
            return _NOT
        return (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.fake_device, a.is_conj(), a.is_neg())
    if a is None or isinstance(a, _SCALARS):
        return a
    if isinstance(a, (list, tuple)):
        parts = tuple(_part(b, mode) for b in a)
        return _NOT if any(p is _NOT for p in parts) else (type(a), parts)
    return _NOT


def _key(func, args, kwargs, mode):
    """What an op's outputs' metadata depend on (None where an argument cannot be keyed): the op, its arguments'
    metadata and values, and the global defaults a factory reads."""
    parts = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled()]
    for a in args:
        parts.append(_part(a, mode))
    for k in sorted(kwargs or {}):
        parts += [k, _part(kwargs[k], mode)]
    return None if any(p is _NOT for p in parts) else tuple(parts)


def _recallable(func) -> bool:
    """An aten op that is not a view, mutates nothing and has no data-dependent output (asked once per op)."""
    got = _RECALLABLE.get(func)
    if got is None:
        got = _RECALLABLE[func] = isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" \
            and not func._schema.is_mutable and not func.is_view \
            and torch.Tag.data_dependent_output not in func.tags and torch.Tag.dynamic_output_shape not in func.tags
    return got


def _recalled(func, args, kwargs):
    """An op that makes new tensors, answered as FakeTensorMode answered the same op on arguments of the same
    metadata (its outputs: new tensors of the shapes, strides, dtypes and devices it gave then)."""
    if not _recallable(func):
        return NotImplemented
    mode = torch._C._get_dispatch_mode(_FAKE_KEY)
    if mode is None:
        return NotImplemented
    key = _key(func, args, kwargs, mode)
    if key is None:
        return NotImplemented
    got = _OUTPUTS.get(key, _NOT)
    if got is _NOT:  # FakeTensorMode answers the first call; its outputs are kept if they are new tensors
        out = func(*args, **(kwargs or {}))
        if len(_OUTPUTS) >= _KEPT:
            _OUTPUTS.clear()
        _OUTPUTS[key] = _fresh(out, args, kwargs, mode)
        return out
    if got is None:
        return NotImplemented
    metas, kind = got
    with in_kernel_invocation_manager(mode):
        made = [None if m is None else FakeTensor(mode, aten.empty_strided.default(m[0], m[1], dtype=m[2], device="meta"), m[3])
                for m in metas]
    return made[0] if kind is None else kind(made)


def _fresh(out, args, kwargs, mode):
    """The outputs' metadata (and their container) where each is None or a new dense tensor of its own storage,
    holding no constant, sharing no storage with an input or another output; else None."""
    from torch._prims_common import compute_required_storage_length

    kind = None if isinstance(out, torch.Tensor) else type(out)
    outs = [out] if kind is None else list(out) if kind in (tuple, list) else None
    if outs is None:
        return None
    taken = set()
    for a in (*args, *(kwargs or {}).values()):
        for b in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(b, torch.Tensor):
                taken.add(b.untyped_storage()._cdata)
    metas = []
    for t in outs:
        if t is None:
            metas.append(None)
            continue
        if not _plain_fake(t, mode) or t.layout is not torch.strided or t.requires_grad or t.storage_offset() \
                or t.is_conj() or t.is_neg():
            return None
        store = t.untyped_storage()
        need = compute_required_storage_length(t.shape, t.stride(), 0) * t.element_size()
        if store._cdata in taken or store.nbytes() != need:
            return None
        taken.add(store._cdata)
        metas.append((tuple(t.shape), t.stride(), t.dtype, t.fake_device))
    return metas, kind
