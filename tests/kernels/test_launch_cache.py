"""memopt.kernels.launch_cache: a compiled Triton kernel is relaunched directly only where Triton's own
binder would have picked the same binary.

The reference is Triton's own specialisation (``native_specialize_impl``, what ``JITFunction.run`` keys
its binaries on): two launches that share a cache entry must get the same specialisation of every
argument. The launches themselves go to a stand-in JIT function that records them (the compiled
launcher needs a GPU; tests/kernels/test_flash_attn.py runs the real one there)."""

import itertools

import pytest
import torch

from memopt.kernels import launch_cache

libtriton = pytest.importorskip("triton._C.libtriton", reason="triton is not installed")
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402


def triton_spec(args):
    return tuple(libtriton.native_specialize_impl(BaseBackend, a, False, True, True) for a in args)


class FakeJit:
    """Records launches: ``fn[grid](...)`` through the binder returns a compiled stand-in whose
    ``[grid](...)`` is the direct launch."""

    def __init__(self, arg_names=("X", "Y", "n", "stride", "scale", "HEAD", "BLOCK")):
        self.arg_names = list(arg_names)
        self.log = []
        fn = self

        class Compiled(CompiledKernel):  # what JITFunction.run returns, launching nothing here
            def __init__(self):
                self.module = None  # nothing loaded (CompiledKernel.__del__ reads it)

            def __getitem__(self, grid):
                return lambda *args: fn.log.append(("direct", grid, args))

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("binder", grid, args, kw))
            return self.compiled
        return run


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(launch_cache, "_CACHE", {})
    monkeypatch.setattr(launch_cache.torch.cuda, "current_device", lambda: 0)


def test_second_launch_is_direct_with_constexprs_in_parameter_order():
    fn = FakeJit()
    x, y = torch.zeros(64, dtype=torch.float16), torch.zeros(64)
    args = (x, y, 64, 32, 0.125)
    for _ in range(2):
        launch_cache.launch(fn, (3, 4), args, {"BLOCK": 16, "HEAD": 64}, {"num_warps": 4})
    assert fn.log[0] == ("binder", (3, 4), args, {"BLOCK": 16, "HEAD": 64, "num_warps": 4})
    # the compiled launcher takes every parameter positionally and three grid dimensions
    assert fn.log[1] == ("direct", (3, 4, 1), (*args, 64, 16))


def test_shared_entries_have_triton_s_specialisation():
    """Every pair of argument tuples that shares an entry is specialised alike by Triton; and each
    class of change Triton specialises on (alignment, ==1, divisibility by 16, 64-bit range, dtype)
    goes through the binder again."""
    buf16 = torch.zeros(256, dtype=torch.float16)
    tensors = [buf16[:64], buf16[8:72], buf16[1:65], torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)]
    ints = [1, 2, 16, 17, 32, 2**31 + 16]
    floats = [0.125, 3.0]
    fn = FakeJit()
    seen: dict[tuple, tuple] = {}  # cache key -> the Triton specialisation its binary was made for
    for x, n, stride, scale in itertools.product(tensors, ints, ints[:3], floats):
        args = (x, tensors[0], n, stride, scale)
        before = len(fn.log)
        launch_cache.launch(fn, (1,), args, {"HEAD": 64, "BLOCK": 16}, {})
        key = next(k for k in launch_cache._CACHE if k[2] == tuple(map(launch_cache._arg_key, args)))
        if fn.log[before][0] == "direct":
            assert seen[key] == triton_spec(args), (args, seen[key], triton_spec(args))
        else:
            seen[key] = triton_spec(args)
    binder = sum(entry[0] == "binder" for entry in fn.log)
    assert binder == len(launch_cache._CACHE)  # one trip through the binder per entry
    # the float's value is not in the key (Triton does not specialise floats): the second one is direct
    assert len(fn.log) - binder >= len(fn.log) // 2


@pytest.mark.parametrize("change", ["constexpr", "option", "device", "bool-vs-int"])
def test_other_key_parts(monkeypatch, change):
    fn = FakeJit()
    x = torch.zeros(64, dtype=torch.float16)
    base = dict(args=(x, x, 1, 16, 0.5), consts={"HEAD": 64, "BLOCK": 16}, opts={"num_warps": 4})
    changed = {
        "constexpr": dict(base, consts={"HEAD": 64, "BLOCK": 32}),
        "option": dict(base, opts={"num_warps": 8}),
        "device": base,
        "bool-vs-int": dict(base, args=(x, x, True, 16, 0.5)),
    }[change]
    launch_cache.launch(fn, (1,), base["args"], base["consts"], base["opts"])
    if change == "device":
        monkeypatch.setattr(launch_cache.torch.cuda, "current_device", lambda: 1)
    launch_cache.launch(fn, (1,), changed["args"], changed["consts"], changed["opts"])
    assert [entry[0] for entry in fn.log] == ["binder", "binder"]


def test_kernel_not_laid_out_as_args_then_constexprs_always_goes_through_triton():
    fn = FakeJit(arg_names=("X", "HEAD", "Y", "n", "stride", "scale", "BLOCK"))  # a constexpr in between
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(3):
        launch_cache.launch(fn, (1,), (x, x, 4, 16, 0.5), {"HEAD": 64, "BLOCK": 16}, {})
    assert [entry[0] for entry in fn.log] == ["binder"] * 3


def test_what_the_key_cannot_describe_goes_through_triton():
    """An argument of another type, a future instead of a binary, an AMD build: every launch through the binder."""
    import numpy as np

    x = torch.zeros(64, dtype=torch.float16)
    fn = FakeJit()
    for _ in range(2):
        launch_cache.launch(fn, (1,), (x, x, np.int64(4), 16, 0.5), {"HEAD": 64, "BLOCK": 16}, {})
    assert [entry[0] for entry in fn.log] == ["binder", "binder"]
    future = FakeJit()
    future.compiled = object()  # not a CompiledKernel
    for _ in range(2):
        launch_cache.launch(future, (1,), (x, x, 4, 16, 0.5), {"HEAD": 64, "BLOCK": 16}, {})
    assert [entry[0] for entry in future.log] == ["binder", "binder"]


def test_an_amd_build_always_goes_through_triton(monkeypatch):
    monkeypatch.setattr(launch_cache, "_ON_NVIDIA", False)
    x = torch.zeros(64, dtype=torch.float16)
    fn = FakeJit()
    for _ in range(2):
        launch_cache.launch(fn, (1,), (x, x, 4, 16, 0.5), {"HEAD": 64, "BLOCK": 16}, {})
    assert [entry[0] for entry in fn.log] == ["binder", "binder"] and not launch_cache._CACHE
