"""Tests for memopt.kernels.flash_attn (Triton FlashAttention forward + backward).

By default the kernels run under Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set below and in conftest.py before triton is
imported).  With ``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the
compiled kernels on the GPU, and the bf16 test runs too.

Every kernel-running test poisons the kernel outputs: the module allocates O,
LSE, delta, dQ, dK and dV through ``_alloc``, which the ``poison`` fixture
replaces with a NaN-filling allocator, so any element a kernel fails to write
shows up as NaN and fails the comparison (``assert_close`` treats NaN as
unequal).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (needed for the FlashAttention kernels)")

from memopt.kernels import flash_attn as fa  # noqa: E402
from memopt.kernels import launch_cache  # noqa: E402
from memopt.kernels.flash_attn import flash_attn, flash_attn_available  # noqa: E402

INTERPRETED = fa._kernels_interpreted()  # triton was imported with TRITON_INTERPRET=1
if INTERPRETED:
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:  # TRITON_INTERPRET explicitly off and no GPU: the kernel tests cannot run; say so loudly.
    DEVICE = None

needs_kernel = pytest.mark.skipif(
    DEVICE is None,
    reason="triton was imported with TRITON_INTERPRET off and no CUDA device is present: nothing can run the kernels",
)

# Tolerances (absolute and relative, applied by torch.testing.assert_close
# against a float64 reference computed from the *same rounded inputs*):
#  * fp32: kernels accumulate in fp32 with IEEE fp32 matmuls (no TF32).  fp32
#    eps is 1.2e-7; reductions over <= 200 keys / 128 dims of O(1) values
#    accumulate a few hundred ulps at worst (observed max error ~5e-7).  1e-5
#    keeps a 20x margin yet is ~1000x tighter than any tiling, masking or
#    softmax-rescaling bug, which shows up as errors >= 1e-2.
#  * fp16: O is rounded to fp16 (eps 9.8e-4) and P / dS are cast to fp16 before
#    their matmuls, as in every fp16 FlashAttention; errors of a few 1e-3 on
#    O(1) values are expected, so 1e-2.
#  * bf16 (CUDA only): bf16 eps is 7.8e-3 -> 5e-2.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
}


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def reference_attention(q, k, v, causal, scale):
    """Plain softmax(Q K^T * scale + mask) V, computed in whatever dtype it is given."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        nq, nk = s.shape[-2], s.shape[-1]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


@pytest.fixture
def poison(monkeypatch):
    """Make every kernel output buffer start as NaN; count the allocations."""
    calls = []

    def nan_alloc(shape, dtype, device):
        calls.append((tuple(shape), dtype))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(fa, "_alloc", nan_alloc)
    return calls


def make_qkv(b, h, nq, nk, d, dtype, gen):
    def rnd(n):
        return torch.randn(b, h, n, d, generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)

    return rnd(nq), rnd(nk), rnd(nk)


def check_against_reference(q, k, v, causal, scale=None, do=None):
    """Run flash_attn fwd+bwd and compare O, dQ, dK, dV with a float64 CPU reference."""
    dtype = q.dtype
    d = q.shape[-1]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn(q, k, v, causal=causal, softmax_scale=scale)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    if do is None:
        do = torch.randn(out.shape, dtype=torch.float32).to(dtype).to(out.device)
    out.backward(do)

    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, causal, sc)
    ref.backward(do.detach().cpu().double())

    tol = TOL[dtype]
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), **tol, msg=lambda m: "O: " + m)
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got is not None and got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu().double(), want, **tol, msg=lambda m, n=name: f"{n}: " + m)


# --------------------------------------------------------------------------
# numerics vs. float64 reference
# --------------------------------------------------------------------------
F32, F16 = torch.float32, torch.float16
_LENGTHS = (1, 17, 129, 200)
# (B, H, Nq, Nk, D, causal, dtype).  Every head dim x {causal, full} x {fp32,
# fp16} once (16 cases), with the sequence length rotating through 1, 17, 129,
# 200 so each (head dim, dtype) pair meets several lengths and every length
# meets causal and full, fp32 and fp16.  None of 17/129/200 is a multiple of the
# 16/32-row interpreter tiles, so masked tails are always exercised; one case
# uses B=2 to check batch strides.  Plus non-causal Nq != Nk both ways
# (see also test_noncausal_backward_nq_ne_nk).
CASES = []
for _i, (_d, _causal, _dtype) in enumerate(
    (d, c, t) for d in (16, 32, 64, 128) for c in (True, False) for t in (F32, F16)
):
    _n = _LENGTHS[(_i + _i // 4) % 4]
    CASES.append((2 if _i == 5 else 1, 2 if _d < 128 else 1, _n, _n, _d, _causal, _dtype))
CASES += [
    (1, 1, 1, 129, 128, False, F16),
    (1, 1, 200, 1, 64, False, F32),
    (1, 2, 17, 200, 32, False, F32),
]


def _case_id(c):
    b, h, nq, nk, d, causal, dtype = c
    return f"B{b}H{h}-q{nq}k{nk}-d{d}-{'causal' if causal else 'full'}-{str(dtype).split('.')[-1]}"


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case, poison):
    b, h, nq, nk, d, causal, dtype = case
    gen = torch.Generator().manual_seed(1000 + nq * 7 + nk * 3 + d)
    q, k, v = make_qkv(b, h, nq, nk, d, dtype, gen)
    check_against_reference(q, k, v, causal)
    # O, LSE in forward; delta, dq, dk, dv in backward -- all poisoned.
    assert len(poison) == 6


@needs_kernel
@pytest.mark.parametrize(
    "nq,nk,d,dtype",
    [(17, 129, 64, F32), (200, 17, 16, F32), (129, 200, 32, F16)],
    ids=["q17-k129-d64-fp32", "q200-k17-d16-fp32", "q129-k200-d32-fp16"],
)
def test_noncausal_backward_nq_ne_nk(nq, nk, d, dtype, poison):
    """The Triton tutorial's backward is only right for causal Nq == Nk; ours must not be."""
    gen = torch.Generator().manual_seed(7 * nq + nk)
    q, k, v = make_qkv(1, 2, nq, nk, d, dtype, gen)
    check_against_reference(q, k, v, causal=False)


@needs_kernel
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_custom_scale(causal, poison):
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(1, 1, 33, 33, 32, F32, gen)
    check_against_reference(q, k, v, causal, scale=0.37)


@needs_kernel
def test_arbitrary_strides(poison):
    """Non-contiguous q/k/v (transposed (B,N,H,D) layout, strided slices) and dO."""
    gen = torch.Generator().manual_seed(11)
    b, h, n, d = 2, 2, 40, 32
    q = torch.randn(b, n, h, d, generator=gen).to(DEVICE).transpose(1, 2)  # (B,H,N,D), stride_n = H*D
    k = torch.randn(b, h, 2 * n, d, generator=gen).to(DEVICE)[:, :, ::2]  # stride_n = 2*D
    v = torch.randn(b, h, d, n, generator=gen).to(DEVICE).transpose(2, 3)  # stride_d = N
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    do = torch.randn(b, n, h, d, generator=gen).to(DEVICE).transpose(1, 2)
    check_against_reference(q, k, v, causal=True, do=do)


@needs_kernel
def test_poison_is_effective(monkeypatch, poison):
    """Sanity-check the harness: an allocation the kernel never writes must fail."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(1, 1, 17, 17, 16, F32, gen)
    real_forward = fa._flash_forward

    def forward_then_forget_tail(*args):
        o, lse = real_forward(*args)
        o[..., -1, :] = float("nan")  # as if the kernel had skipped the masked tail row
        return o, lse

    monkeypatch.setattr(fa, "_flash_forward", forward_then_forget_tail)
    with pytest.raises(AssertionError, match="O: "):
        check_against_reference(q, k, v, causal=True)


# --------------------------------------------------------------------------
# memory: saved-for-backward bytes are O(N), naive attention's O(N^2)
# --------------------------------------------------------------------------
def _saved_bytes(fn, *inputs):
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[(st.device.type, st.data_ptr())] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(storages.values())


@needs_kernel
def test_saved_bytes_grow_linearly(poison):
    d = 16
    flash, naive = {}, {}
    for n in (128, 512):
        gen = torch.Generator().manual_seed(n)
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, n, n, d, F32, gen))
        flash[n] = _saved_bytes(lambda a, b_, c: flash_attn(a, b_, c, causal=True), q, k, v)
        naive[n] = _saved_bytes(lambda a, b_, c: reference_attention(a, b_, c, True, 1 / math.sqrt(d)), q, k, v)
        # q, k, v, O (4 * N * D * 4 bytes) + LSE (N * 4 bytes) and nothing else.
        assert flash[n] == 4 * n * d * 4 + n * 4, (n, flash[n])
    flash_ratio = flash[512] / flash[128]
    naive_ratio = naive[512] / naive[128]
    assert 3.5 <= flash_ratio <= 4.5, flash_ratio
    assert naive_ratio >= 10.0, naive_ratio  # ~16x for the N^2 probability matrix
    assert naive[512] > 10 * flash[512]


# --------------------------------------------------------------------------
# bf16: GPU only
# --------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED,
    reason="Triton's interpreter cannot compute bf16 tl.dot; bf16 path is covered on CUDA only "
    "(run on a CUDA machine with TRITON_INTERPRET=0)",
)
@pytest.mark.parametrize("causal,nq,nk,d", [(True, 200, 200, 64), (False, 129, 17, 128)])
def test_bf16_cuda(causal, nq, nk, d, poison):
    gen = torch.Generator().manual_seed(42)
    q, k, v = make_qkv(2, 2, nq, nk, d, torch.bfloat16, gen)
    check_against_reference(q, k, v, causal)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                    reason="autotuning runs on compiled kernels only (a CUDA machine with TRITON_INTERPRET=0)")
def test_autotuned_choice_reused_without_the_autotuner_cuda(monkeypatch):
    """The first call per shape autotunes; later calls launch the plain kernels with the remembered choice
    (fa._launch_tuned). Both give the float64 reference's values, and the same bits as each other."""
    monkeypatch.setenv("MEMOPT_FLASH_NO_AUTOTUNE", "0")
    monkeypatch.setattr(fa, "_TUNED", {})
    monkeypatch.setattr(launch_cache, "_CACHE", {})
    gen = torch.Generator().manual_seed(7)
    q, k, v = make_qkv(2, 3, 333, 333, 64, torch.float16, gen)
    do = torch.randn(q.shape, generator=gen).to(torch.float16).to(DEVICE)
    runs = []
    for _ in range(3):  # autotuned; through Triton's binder with the choice; the cached binaries relaunched
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flash_attn(qq, kk, vv, causal=True)
        out.backward(do)
        runs.append((out.detach(), qq.grad, kk.grad, vv.grad))
        assert {key[0] for key in fa._TUNED} == {"fwd", "dkdv", "dq"}
    assert sum(entry[1] is not None for entry in launch_cache._CACHE.values()) == 3  # relaunched directly
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(a, b)
    check_against_reference(q, k, v, True, do=do)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                    reason="the launch cache holds compiled binaries (a CUDA machine with TRITON_INTERPRET=0)")
@pytest.mark.parametrize("autotune", [False, True])
def test_relaunch_keeps_triton_s_specialisation_cuda(monkeypatch, autotune):
    """Calls with the same shapes and strides from addresses 2 bytes off 16-byte alignment, after aligned
    ones: the launch cache must not relaunch the binary Triton specialised for aligned pointers
    (memopt.kernels.launch_cache); every call gives the float64 reference's values."""
    monkeypatch.setenv("MEMOPT_FLASH_NO_AUTOTUNE", "0" if autotune else "1")
    monkeypatch.setattr(fa, "_TUNED", {})
    monkeypatch.setattr(launch_cache, "_CACHE", {})
    gen = torch.Generator().manual_seed(11)
    shape = (1, 2, 129, 64)
    numel = math.prod(shape)
    bufs = [torch.randn(numel + 8, generator=gen).to(torch.float16).to(DEVICE) for _ in range(3)]
    for off in (0, 0, 0, 1, 1):
        q, k, v = (buf[off:off + numel].view(shape) for buf in bufs)
        assert (q.data_ptr() % 16 == 0) == (off == 0)
        check_against_reference(q, k, v, True)


@pytest.mark.skipif(not INTERPRETED, reason="checks the interpreter-only bf16 refusal; kernels are compiled here")
def test_bf16_refused_under_interpreter(no_kernel):
    q = torch.randn(1, 1, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16.*interpreter|interpreter.*bf16"):
        flash_attn(q, q, q)


# --------------------------------------------------------------------------
# validation errors (no kernel runs: _flash_forward is replaced by a tripwire)
# --------------------------------------------------------------------------
@pytest.fixture
def no_kernel(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("validation should have failed before any kernel launch")

    monkeypatch.setattr(fa, "_flash_forward", tripwire)


def t4(b=1, h=2, n=8, d=16, dtype=torch.float32, device="cpu"):
    return torch.randn(b, h, n, d, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((torch.randn(2, 8, 16), t4(), t4()), ValueError, "4-D"),
        ((t4(), torch.randn(1, 1, 2, 8, 16), t4()), ValueError, "4-D"),
        ((t4(b=1), t4(b=2), t4(b=2)), ValueError, "batch"),
        ((t4(h=2), t4(h=2), t4(h=3)), ValueError, "head counts"),
        ((t4(d=16), t4(d=32), t4(d=32)), ValueError, "head dims differ"),
        ((t4(n=8), t4(n=8), t4(n=9)), ValueError, "k and v sequence lengths"),
        ((t4(d=48), t4(d=48), t4(d=48)), ValueError, r"unsupported head dim 48.*\[16, 32, 64, 128\]"),
        ((t4(d=256), t4(d=256), t4(d=256)), ValueError, r"unsupported head dim 256"),
        ((t4(), t4(dtype=torch.float16), t4()), TypeError, "share a dtype"),
        ((t4(dtype=torch.float64),) * 3, TypeError, "unsupported dtype torch.float64"),
        ((t4(n=0), t4(), t4()), ValueError, ">= 1"),
        ((t4().numpy(), t4(), t4()), TypeError, "torch.Tensor"),
    ],
    ids=[
        "q-3d", "k-5d", "batch-mismatch", "heads-mismatch", "headdim-mismatch", "kv-len-mismatch",
        "headdim-48", "headdim-256", "dtype-mismatch", "dtype-float64", "empty-seq", "not-a-tensor",
    ],
)
def test_validation_errors(args, exc, match, no_kernel):
    with pytest.raises(exc, match=match):
        flash_attn(*args, causal=False)


def test_causal_requires_equal_lengths(no_kernel):
    with pytest.raises(ValueError, match=r"causal attention requires Nq == Nk.*Nq=8, Nk=12"):
        flash_attn(t4(n=8), t4(n=12), t4(n=12), causal=True)


def test_device_mismatch(no_kernel):
    with pytest.raises(ValueError, match="same device"):
        flash_attn(t4(), t4(device="meta"), t4())


def test_nonfinite_scale(no_kernel):
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn(t4(), t4(), t4(), softmax_scale=float("nan"))


def test_cpu_without_interpreter_is_refused(monkeypatch, no_kernel):
    """CPU tensors without TRITON_INTERPRET=1: clear error, no silent SDPA fallback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"needs CUDA, or TRITON_INTERPRET=1"):
        flash_attn(t4(), t4(), t4())
    ok, why = flash_attn_available("cpu")
    assert not ok and "TRITON_INTERPRET=1" in why and "CUDA" in why
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"needs CUDA, or TRITON_INTERPRET=1"):
        flash_attn(t4(), t4(), t4())


def test_flash_attn_available_reports():
    ok, why = flash_attn_available(torch.device("meta"))
    assert not ok and "meta" in why
    ok, why = flash_attn_available("cuda")
    assert ok == torch.cuda.is_available()
    if not ok:
        assert "CUDA" in why
    ok, why = flash_attn_available("cpu")
    if INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1":
        assert ok and why == ""
    else:
        assert not ok and why


# --------------------------------------------------------------------------
# GPU code path without a GPU: block-size selection and compilation for sm_90
# --------------------------------------------------------------------------
@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_block_choices(d, elem):
    for interpreted in (True, False):
        blk = fa._fixed_blocks(d, interpreted, elem)
        for bm, bn in (blk.fwd, blk.dkdv, blk.dq):
            assert bm >= 16 and bn >= 16  # tl.dot needs >= 16 per dimension
            assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0
    ks = fa._kernels(False)  # compiled wrappers (only constructed here, never launched)
    for tuned in (ks.fwd_tuned, ks.dkdv_tuned, ks.dq_tuned):
        q = torch.empty(0, dtype=torch.float32 if elem == 4 else torch.float16)
        kept = fa._prune_for_head_dim(tuned.configs, {"Q": q}, HEAD_DIM=d)
        assert kept, "pruning must leave at least one config"
        budget = (128 * 128 if d <= 64 else 128 * 64) // (2 if elem == 4 else 1)
        assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= budget for c in kept)


_COMPILE_SCRIPT = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
try:
    import triton
    from triton.compiler.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
except ImportError as e:
    print("compile API unavailable:", e); sys.exit(77)
from memopt.kernels import flash_attn as fa
assert not fa._kernels_interpreted()
ks = fa._kernels(False)
PTR = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
def compile_one(fn, dt, consts, blk):
    sig = {}
    for name in fn.arg_names:
        if name in consts: sig[name] = "constexpr"
        elif name in ("LSE", "DELTA"): sig[name] = "*fp32"
        elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"): sig[name] = PTR[dt]
        elif name in ("qk_scale_log2", "sm_scale"): sig[name] = "fp32"
        else: sig[name] = "i32"
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=blk.num_warps, num_stages=blk.num_stages))
def masked_loops(ttir):
    # Per tile loop (scf.for, not nested here), in program order: does its body compare or select?
    bodies = [b.split("scf.yield")[0] for b in ttir.split("scf.for ")[1:]]
    return ["masked" if ("arith.cmpi" in b or "arith.select" in b) else "unmasked" for b in bodies]
# The stage split: off-band tiles and whole tiles run in loops with no mask at all.
STAGES = {
    ("fwd", True): ["unmasked", "masked"], ("fwd", False): ["unmasked", "masked"],
    ("dq", True): ["unmasked", "masked"], ("dq", False): ["unmasked", "masked"],
    ("dkdv", True): ["masked", "unmasked", "masked"], ("dkdv", False): ["unmasked", "masked"],
}
n = 0
for dt, d, causal in (("fp16", 128, True), ("bf16", 128, True), ("bf16", 64, False), ("fp32", 64, True)):
    blk = fa._fixed_blocks(d, False, 4 if dt == "fp32" else 2)
    c = dict(HEAD_DIM=d, CAUSAL=causal, DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
    for name, fn, (bm, bn) in (("fwd", ks.fwd, blk.fwd), ("dkdv", ks.dkdv, blk.dkdv), ("dq", ks.dq, blk.dq)):
        kernel = compile_one(fn, dt, {**c, "BLOCK_M": bm, "BLOCK_N": bn}, blk); n += 1
        loops = masked_loops(kernel.asm["ttir"])
        assert loops == STAGES[name, causal], (name, dt, d, causal, loops)
print("compiled", n)
"""


@pytest.mark.slow  # 30 s: ahead-of-time compilation for a GPU target; the interpreter tests run by default
def test_kernels_compile_for_sm90():
    """Compile the GPU kernels (fp16/bf16/fp32, causal and not) to sm_90 cubin, no GPU needed.

    The interpreter never runs Triton's compiler, so this catches GPU-only
    errors (dot operand shapes/dtypes, input_precision, layouts) on CPU CI, and
    is the only CPU-side check the bf16 path gets.  It also reads the compiled
    TTIR: the off-band (causal) and whole-tile loops must hold no compare or
    select, i.e. the stage split survives compilation.
    """
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    if res.returncode == 77:
        pytest.skip("this Triton has no triton.compiler.ASTSource/GPUTarget API: " + res.stdout.strip())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "compiled 12" in res.stdout  # 4 variants x (forward, dQ, dK/dV)


_ORDER_SCRIPT = r"""
import os, sys, torch
late = sys.argv[1] == "late"
if late:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton  # compiled mode, fixed for this process
from memopt.kernels.flash_attn import flash_attn, flash_attn_available
if not late:
    import triton
os.environ["TRITON_INTERPRET"] = "1"
q, k, v = (torch.randn(1, 1, 19, 16, requires_grad=True) for _ in range(3))
ok, why = flash_attn_available("cpu")
if late:
    assert not ok and "before triton" in why, why
    try:
        flash_attn(q, k, v)
    except RuntimeError as e:
        assert "before triton" in str(e), e
        print("refused")
    sys.exit(0)
if not ok and "tile loops" in why:  # an interpreter that cannot run the kernels here (an unpinned triton)
    print("unsupported:", why)
    sys.exit(0)
assert (ok, why) == (True, ""), why
o = flash_attn(q, k, v, causal=True)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
o.sum().backward()
assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
print("ok")
"""


@pytest.mark.parametrize("order", ["memopt-first", "late"])
def test_import_order(order):
    """TRITON_INTERPRET set before memopt's import works whether memopt or triton is imported first;
    set only after triton was imported, CPU calls are refused with an explanation, not a crash."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _ORDER_SCRIPT, order], env=env, capture_output=True, text=True, timeout=300
    )
    if "unsupported:" in res.stdout:
        pytest.skip(res.stdout.split("unsupported:", 1)[1].strip())
    want = "refused" if order == "late" else "ok"
    assert res.returncode == 0 and res.stdout.strip().endswith(want), res.stdout[-3000:] + res.stderr[-3000:]
