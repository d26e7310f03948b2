"""Relaunch a compiled Triton kernel without Triton's per-launch argument binding.

Why: at N = 1k a FlashAttention forward + backward is bound by the host, not the GPU, and part of that
host time is Triton's ``JITFunction.run`` binding and specialising the kernels' ~40 arguments on every
launch, three launches a call (experiments/flash_attn/README.md: on an H200 the median host time of the
GPU check's twelve cases went from 0.79 to 0.74 ms with this cache, within that host's noise). The first
launch for a key goes through ``JITFunction.run``, which compiles or finds the binary and returns it; later
launches with the same key call that binary's launcher (``CompiledKernel[grid](*args)``) directly.

The key holds everything Triton specialises a binary on: each integer argument's value (Triton
specialises on == 1, on divisibility by 16 and on the 32/64-bit range), each tensor's dtype and whether
its address is 16-byte aligned, the constexprs and the launch options, the current device. So a launch
reuses a binary only where Triton's own binder would have picked the same one. Floats are not
specialised by Triton (their value is not in the key). Compiled launches on NVIDIA GPUs only: the interpreter
has no binary to keep, and Triton's AMD backend also specialises on a tensor's size (buffer ops), which the
key does not hold. Not in the key either: Triton's debug and instrumentation switches (``knobs``), read when a
binary is first made; a process that flips them between launches of one shape keeps the first binary.
"""
from __future__ import annotations

import torch

_UNKEYED = object()  # an argument the key cannot describe: that launch goes through Triton
_ON_NVIDIA = torch.version.hip is None
_MAX_ENTRIES = 512  # shapes seen by one process; past this the cache starts again (a model has a handful)
_CACHE: dict[tuple, tuple] = {}  # key -> (jit function, compiled kernel or None, constexpr values in order)


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):  # before int: True == 1 would share a key with the integer 1
        return ("bool", a)
    if isinstance(a, int):
        return a
    if isinstance(a, float):
        return float
    return _UNKEYED


def launch(fn, grid: tuple, args: tuple, constexprs: dict, options: dict) -> None:
    """``fn[grid](*args, **constexprs, **options)``, through Triton's binder the first time per key only.

    ``args`` are the kernel's leading runtime parameters in order and ``constexprs`` the trailing ones by
    name (a kernel laid out otherwise is always launched through Triton)."""
    arg_keys = tuple(map(_arg_key, args))
    if not _ON_NVIDIA or _UNKEYED in arg_keys:
        fn[grid](*args, **constexprs, **options)
        return
    key = (id(fn), torch.cuda.current_device(), arg_keys, tuple(constexprs.items()), tuple(options.items()))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is fn and hit[1] is not None:
        hit[1][(*grid, 1, 1)[:3]](*args, *hit[2])  # the compiled launcher reads three grid dimensions
        return
    compiled = fn[grid](*args, **constexprs, **options)
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.clear()
    names = list(getattr(fn, "arg_names", ()))
    tail = names[len(args):]
    usable = (_is_binary(compiled) and len(names) == len(args) + len(constexprs) and set(tail) == set(constexprs))
    _CACHE[key] = (fn, compiled if usable else None, tuple(constexprs[n] for n in tail) if usable else ())


def _is_binary(compiled) -> bool:
    """A binary Triton finished compiling (with async compilation ``JITFunction.run`` may return a future)."""
    from triton.compiler.compiler import CompiledKernel

    return isinstance(compiled, CompiledKernel)
