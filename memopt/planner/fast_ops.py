"""Fake ops whose result is known without FakeTensorMode's dispatch: views, in-place updates, ``empty``.

Why: a plan is ~40k ops on fake tensors, each ~0.1-0.3 ms, and most of that time is FakeTensorMode's
generic machinery (a cache key built from every argument, the output rebuilt from the cache entry),
not the op. For a few op kinds the output follows from the inputs alone:

* a view (``view``, ``as_strided``, ``slice``, ``detach``, ``t``, ``transpose``) is the op's meta kernel
  run on the fake input, which aliases its storage, wrapped as a fake tensor on the input's device:
  what FakeTensorMode itself does, without the cache key;
* an in-place update (``add_``, ``zero_``, ``mul_``, ``div_``) returns its first argument (FakeTensorMode's
  cache returns exactly that for an in-place op; autograd bumps the version above the dispatch modes);
* ``empty`` (on the CPU, where the planner puts every tensor) is its meta tensor on that device, and so is
  ``randn`` (a fake tensor holds no values; the parameters' initialisation draws one each);
* ``prim.device`` of a fake tensor is its fake device (FakeTensorMode's own handler, reached directly).

Nothing the planner counts differs: a view or an in-place op makes no storage (the tracker skips its
output), none of these ops has a FLOP formula or is a collective, and a copy between memories (offload
traffic) is not among them. Only tensors FakeTensorMode made itself, holding no propagated constant
(a ``.item()`` reads those), on the mode that would run the op, take this path; anything else falls
through to FakeTensorMode. ``run`` returns ``NotImplemented`` then.

Measured (gpt_10b on PatrickStar's 8 ranks, chunk engine): ~11k of rank 0's ~14k ops are answered here,
besides its ~10k device queries; the two ranks' recording and replays took ~40% less CPU time. Tested: tests/planner/test_fast_ops.py (op by op against
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
                   aten.t.default, aten.transpose.int})
INPLACE = frozenset({aten.add_.Tensor, aten.zero_.default, aten.mul_.Tensor, aten.div_.Tensor})
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
            y = args[1]  # what the kernel would reject: another device, a shape that does not broadcast into x
            if y.fake_device != x.fake_device or torch.broadcast_shapes(x.shape, y.shape) != x.shape:
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
    return NotImplemented
