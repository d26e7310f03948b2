"""memopt.optim.cpu_adam.CPUAdamW: both paths (the compiled C++ kernel and the torch fallback)
against an independent float64 AdamW, against torch.optim.AdamW, and their bookkeeping.

Tolerance against the float64 reference. Both paths compute in fp32 (unit roundoff
u = 2**-24 ~ 6e-8). Per step, the new parameter p*(1 - lr*wd) - s*m/(sqrt(v)/c + eps) gets a
rounding error of about one ulp of |p| from the multiply/subtract and a relative error of a few
ulp on the update term, whose size is lr * |m_hat / (sqrt(v_hat) + eps)| <= lr * R (R ~ 3 for
the gradients used here). m and v carry a few ulp of relative error each (m also an absolute
few-ulp error of |g| when its terms cancel), and those enter the update linearly. Errors add
over steps, so after K steps

    |p - p_ref| <= C * K * u * (|p_ref| + lr_max * R),   C = 8

with headroom: the largest observed |p - p_ref| is 0.15 of this bound (both paths). It is also
tight enough to catch real mistakes: weight decay off by 1 %, or beta2 0.951 instead of 0.95,
exceed it 15-200x on the larger tensors.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from memopt.optim import cpu_adam
from memopt.optim.cpu_adam import CPUAdamW

U32 = 2.0**-24
SIZES = [1, 7, 1000, 4099, 70001]  # 4099, 70001: not multiples of 8/16/64/128; 70001 spans 3 chunks
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _have_compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


@pytest.fixture(scope="module", params=["cpp", "torch"])
def impl(request):
    if request.param == "cpp" and not cpu_adam.kernel_available():
        if _have_compiler():  # a compiler is here, so a failed build is a bug, not an environment gap
            pytest.fail(f"C++ kernel failed to build: {cpu_adam.kernel_error()}")
        pytest.skip(f"no C++ compiler: {cpu_adam.kernel_error()}")
    return request.param


def reference_adamw(p0, grads_per_step, lrs, wds_per_step, betas, eps, grad_scale=1.0):
    """AdamW in float64, written from the torch.optim.AdamW docs / Loshchilov & Hutter (2019)."""
    b1, b2 = betas
    p = [x.double().clone() for x in p0]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, (grads, lr, wds) in enumerate(zip(grads_per_step, lrs, wds_per_step), start=1):
        for i, g in enumerate(grads):
            g = g.double() / grad_scale
            p[i] = p[i] - lr * wds[i] * p[i]  # decoupled weight decay
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2**t)
            p[i] = p[i] - lr * m_hat / (v_hat.sqrt() + eps)
    return p, m, v


def _err_ratio(got, ref, k_steps, lr_max, r=3.0, c=8.0):
    """max over elements of |got - ref| / (C K u (|ref| + lr_max R)); <= 1 passes."""
    bound = c * k_steps * U32 * (ref.abs() + lr_max * r)
    return ((got.double() - ref).abs() / bound).max().item()


def _problem(seed=0, sizes=SIZES, steps=6):
    gen = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) * (0.1 if i % 2 else 1.0) for i, n in enumerate(sizes)]
             for _ in range(steps)]
    lrs = [1e-2 * (0.5 + 0.25 * s) for s in range(steps)]  # varying lr, up to 2.25e-2
    # weight decay on for even tensors, off for odd ones, and changed on one step
    wds = [[(0.1 if i % 2 == 0 else 0.0) * (2.0 if s == 3 else 1.0) for i in range(len(sizes))]
           for s in range(steps)]
    return p0, grads, lrs, wds


@pytest.mark.parametrize("fp32_out", [False, True], ids=["no_out", "fp32_out"])
def test_matches_float64_reference(impl, fp32_out):
    """fp32_out: the updated params are also written into fp32 tensors in the same pass (one of them
    misaligned by an element), which must carry the same reference values."""
    betas, eps = (0.9, 0.95), 1e-8
    p0, grads, lrs, wds = _problem()
    params = [x.clone() for x in p0]
    outs = [torch.full_like(x, float("nan")) for x in p0[:-1]] + [torch.empty(p0[-1].numel() + 1)[1:]]
    opt = CPUAdamW(params, lr=1.0, betas=betas, eps=eps, impl=impl)
    assert opt.impl == impl
    for g, lr, wd in zip(grads, lrs, wds):
        opt.step(g, lr=lr, weight_decays=wd, out=outs if fp32_out else None)
    assert opt.step_count == len(grads)
    ref_p, ref_m, ref_v = reference_adamw(p0, grads, lrs, wds, betas, eps)
    k = len(grads)
    for i in range(len(p0)):
        assert _err_ratio(params[i], ref_p[i], k, max(lrs)) <= 1.0, f"param {i} (n={p0[i].numel()})"
        if fp32_out:
            assert _err_ratio(outs[i], ref_p[i], k, max(lrs)) <= 1.0, f"out {i} (n={p0[i].numel()})"
        gmax = max(g[i].abs().max().item() for g in grads)
        torch.testing.assert_close(opt.exp_avg[i].double(), ref_m[i], rtol=0, atol=8 * k * U32 * gmax)
        torch.testing.assert_close(opt.exp_avg_sq[i].double(), ref_v[i], rtol=8 * k * U32,
                                   atol=8 * k * U32 * gmax**2 * 1e-3)
    # not vacuous: the parameters moved by far more than the tolerance
    assert (params[2].double() - p0[2].double()).abs().max() > 1e-3


def test_matches_torch_optim_adamw(impl):
    betas, eps = (0.9, 0.999), 1e-8
    p0, grads, lrs, _ = _problem(seed=1, steps=5)
    decay, no_decay = [0, 2, 4], [1, 3]
    ours = [x.clone() for x in p0]
    theirs = [torch.nn.Parameter(x.clone()) for x in p0]
    opt = CPUAdamW(ours, lr=1e-3, betas=betas, eps=eps, weight_decay=0.1, impl=impl)
    ref = torch.optim.AdamW([{"params": [theirs[i] for i in decay], "weight_decay": 0.1},
                             {"params": [theirs[i] for i in no_decay], "weight_decay": 0.0}],
                            lr=1e-3, betas=betas, eps=eps, foreach=False)
    wds = [0.1 if i in decay else 0.0 for i in range(len(p0))]
    for g, lr in zip(grads, lrs):
        for t, gi in zip(theirs, g):
            t.grad = gi.clone()
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        opt.step(g, lr=lr, weight_decays=wds)
    for i, t in enumerate(theirs):
        # fp32 vs fp32, different operation order: agreement to a few ulp of |p| per step
        torch.testing.assert_close(ours[i], t.detach(), rtol=2e-6, atol=5 * 8 * U32 * max(lrs))
        torch.testing.assert_close(opt.exp_avg[i], ref.state[t]["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(opt.exp_avg_sq[i], ref.state[t]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_state_dict_round_trip(impl):
    p0, grads, lrs, wds = _problem(seed=2, steps=5)
    a_params = [x.clone() for x in p0]
    a = CPUAdamW(a_params, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, impl=impl)
    for g, lr in zip(grads[:3], lrs):
        a.step(g, lr=lr)
    buf = io.BytesIO()
    torch.save({"params": a_params, "optim": a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    b_params = saved["params"]
    b = CPUAdamW(b_params, impl=impl)  # different hyper-parameters: the state dict restores them
    m_before = b.exp_avg[0]
    b.load_state_dict(saved["optim"])
    assert b.exp_avg[0] is m_before  # loaded into its own buffers
    assert (b.step_count, b.lr, b.betas, b.eps, b.weight_decay) == (3, 1e-2, (0.8, 0.99), 1e-7, 0.05)
    for g in grads[3:]:
        a.step(g)
        b.step(g)
    for x, y in zip(a_params + a.exp_avg + a.exp_avg_sq, b_params + b.exp_avg + b.exp_avg_sq):
        assert torch.equal(x, y)
    assert a.state_nbytes == b.state_nbytes == 8 * sum(SIZES)
    bad = a.state_dict()
    bad["exp_avg"] = [torch.zeros(2)] + bad["exp_avg"][1:]
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_copy_out(impl, dtype):
    """The copy written in the same pass is Tensor.to(dtype) of the updated fp32 param, bit for bit
    (fp32: the param itself, e.g. a ZeRO-Offload run's fp32 parameters next to the host master)."""
    sizes = [1, 7, 300, 4099, 70001]
    p0, grads, lrs, _ = _problem(seed=3, sizes=sizes, steps=2)
    p0[3][:5] = torch.tensor([1e-41, -3e-39, 7e4, 1e5, -1e-7])  # fp32 denormals, fp16 overflow/underflow
    params = [x.clone() for x in p0]
    opt = CPUAdamW(params, lr=1e-3, weight_decay=0.1, impl=impl)
    # a misaligned output (offset by one element) exercises the non-streaming store path
    outs = [torch.empty(n, dtype=dtype) for n in sizes[:-1]] + [torch.empty(sizes[-1] + 1, dtype=dtype)[1:]]
    for g in grads:
        opt.step(g, out=outs)
        for p, o in zip(params, outs):
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            assert torch.equal(o.view(bits), p.to(dtype).view(bits))
    # the copy does not change the fp32 result
    plain = [x.clone() for x in p0]
    opt2 = CPUAdamW(plain, lr=1e-3, weight_decay=0.1, impl=impl)
    for g in grads:
        opt2.step(g)
    for x, y in zip(params, plain):
        assert torch.equal(x, y)


def test_low_precision_nan_stays_nan(impl):
    p = torch.tensor([float("nan"), 1.0, float("inf")] * 50)
    opt = CPUAdamW([p], impl=impl)
    out = torch.empty(150, dtype=torch.bfloat16)
    opt.step([torch.ones(150)], out=[out])
    assert out[0::3].isnan().all() and out[2::3].isinf().all() and out[1::3].isfinite().all()


def test_grad_scale_and_none_grads(impl):
    p0, grads, lrs, _ = _problem(seed=4, steps=3)
    a_params, b_params = [x.clone() for x in p0], [x.clone() for x in p0]
    a = CPUAdamW(a_params, lr=1e-2, weight_decay=0.1, impl=impl)
    b = CPUAdamW(b_params, lr=1e-2, weight_decay=0.1, impl=impl)
    for g in grads:
        a.step(g)
        scaled = [x * 1024.0 for x in g]  # a power of two: unscaling is exact in both paths
        b.step(scaled, grad_scale=1024.0)
        if impl == "cpp":
            assert all(torch.equal(s, x * 1024.0) for s, x in zip(scaled, g))  # grads not modified
    for x, y in zip(a_params, b_params):
        assert torch.equal(x, y)
    # a None grad leaves that tensor and its states alone; the shared counter still advances
    before = [x.clone() for x in a_params]
    a.step([None] + grads[0][1:])
    assert torch.equal(a_params[0], before[0]) and not torch.equal(a_params[1], before[1])
    assert a.step_count == 4


def test_errors(impl):
    with pytest.raises(ValueError, match="fp32"):
        CPUAdamW([torch.zeros(3, dtype=torch.float16)], impl=impl)
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdamW([torch.zeros(4, 4).t()], impl=impl)
    opt = CPUAdamW([torch.zeros(3), torch.zeros(5)], impl=impl)
    with pytest.raises(ValueError, match="grads"):
        opt.step([torch.zeros(3)])
    with pytest.raises((RuntimeError, ValueError)):
        opt.step([torch.zeros(3), torch.zeros(4)])  # wrong numel
    with pytest.raises((RuntimeError, ValueError)):
        opt.step([torch.zeros(3), torch.zeros(5)], out=[torch.empty(3, dtype=torch.float64), torch.empty(5)])
    with pytest.raises((RuntimeError, ValueError)):
        opt.step([torch.zeros(3), torch.zeros(5)], out=[torch.empty(3), opt.params[1]])  # the param itself
    assert opt.step_count == 0  # a rejected step does not advance the counter
    with pytest.raises(ValueError, match="impl"):
        CPUAdamW([torch.zeros(3)], impl="fast")


def test_cpp_bitwise_independent_of_threads_and_splits():
    if not cpu_adam.kernel_available():
        pytest.skip(f"C++ kernel unavailable: {cpu_adam.kernel_error()}")
    gen = torch.Generator().manual_seed(5)
    n = 100_003
    flat0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    cuts = [0, 1, 130, 4099, 40000, n]

    def run(threads, split):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            flat = flat0.clone()
            views = [flat[a:b] for a, b in zip(cuts, cuts[1:])] if split else [flat]
            opt = CPUAdamW(views, lr=1e-2, weight_decay=0.1, impl="cpp")
            for g in grads:
                opt.step([g[a:b] for a, b in zip(cuts, cuts[1:])] if split else [g])
            return flat
        finally:
            torch.set_num_threads(old)

    base = run(1, False)
    assert torch.equal(base, run(2, False))
    assert torch.equal(base, run(2, True))
    assert torch.equal(base, run(1, True))


def test_fallback_when_kernel_cannot_build(tmp_path):
    """No usable compiler: impl='auto' warns and runs the torch path, impl='cpp' raises clearly."""
    code = textwrap.dedent("""
        import warnings, torch
        from memopt.optim import cpu_adam
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt = cpu_adam.CPUAdamW([torch.zeros(5)])
        assert opt.impl == "torch", opt.impl
        assert any("C++ kernel unavailable" in str(x.message) for x in w), [str(x.message) for x in w]
        opt.step([torch.ones(5)])
        try:
            cpu_adam.CPUAdamW([torch.zeros(5)], impl="cpp")
        except RuntimeError as e:
            assert "could not be built" in str(e) and "/nonexistent" in str(e), str(e)
        else:
            raise AssertionError("impl='cpp' did not raise")
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CXX="/nonexistent/c++", MEMOPT_CPU_ADAM_CFLAGS="-DMEMOPT_TEST_NO_COMPILER",
               TORCH_EXTENSIONS_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("cflags,width", [("-mno-avx512f", 8), ("-DMEMOPT_PORTABLE", 1)])
def test_other_simd_paths(tmp_path, cflags, width):
    """The AVX2 and portable code paths (x86 machines with AVX-512 otherwise build only that one)."""
    if not _have_compiler():
        pytest.skip("no C++ compiler")
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.join(REPO, 'tests', 'unit')!r})
        import test_cpu_adam as t
        from memopt.optim import cpu_adam
        assert cpu_adam.kernel_available(), cpu_adam.kernel_error()
        w = cpu_adam.kernel_simd_width()
        if {width} == 8 and w != 8:
            print("SKIP: no AVX2 here"); raise SystemExit(0)
        assert w == {width}, w
        t.test_matches_float64_reference("cpp", False)
        t.test_matches_float64_reference("cpp", True)
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            t.test_copy_out("cpp", dt)
        t.test_cpp_bitwise_independent_of_threads_and_splits()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MEMOPT_CPU_ADAM_CFLAGS=cflags)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and ("OK" in res.stdout or "SKIP" in res.stdout), res.stdout + res.stderr


@pytest.mark.parametrize("gdtype", [torch.float16, torch.bfloat16], ids=["fp16_grads", "bf16_grads"])
def test_low_precision_grads_are_read_exactly(impl, gdtype):
    """fp16/bf16 gradients (the chunk engine's payloads) give the float64 reference's trajectory of the
    gradients' exact fp32 values: widening fp16/bf16 to fp32 is exact, so any error is the fp32 step's."""
    betas, eps = (0.9, 0.95), 1e-8
    p0, grads, lrs, wds = _problem(seed=3)
    grads = [[g.to(gdtype) for g in step] for step in grads]
    params = [x.clone() for x in p0]
    opt = CPUAdamW(params, lr=1.0, betas=betas, eps=eps, impl=impl)
    for g, lr, wd in zip(grads, lrs, wds):
        opt.step([x.clone() for x in g], lr=lr, weight_decays=wd, grad_scale=4.0)
    ref_p, _, _ = reference_adamw(p0, [[x.float() for x in g] for g in grads], lrs, wds, betas, eps, grad_scale=4.0)
    for got, ref in zip(params, ref_p):
        assert _err_ratio(got, ref, len(lrs), max(lrs)) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_out_may_share_the_gradients_memory(impl, dtype):
    """The chunk engine's reused payload: read as the gradient, written with the new parameters, in one
    call. The result equals the same step with a separate output (and separate gradient) tensor."""
    gen = torch.Generator().manual_seed(5)
    n = 70001
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(dtype)
    a = CPUAdamW([p.clone()], lr=1e-2, impl=impl)
    b = CPUAdamW([p.clone()], lr=1e-2, impl=impl)
    sep_out = torch.empty(n, dtype=dtype)
    a.step([g.clone()], out=[sep_out], grad_scale=2.0)
    shared = g.clone()
    b.step_views(b.params, [shared], b.exp_avg, b.exp_avg_sq, [0.0], out=[shared], grad_scale=2.0)
    assert torch.equal(b.params[0], a.params[0])
    assert torch.equal(shared, sep_out)
    assert torch.equal(sep_out, a.params[0].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sumsq_against_float64(impl, dtype, monkeypatch):
    """sumsq over several tensors of odd sizes against float64 arithmetic; an inf or a NaN anywhere makes
    it not finite (the chunk engine's overflow vote)."""
    if impl == "torch":
        monkeypatch.setenv("MEMOPT_CPU_ADAM", "torch")
    gen = torch.Generator().manual_seed(9)
    xs = [(torch.randn(n, generator=gen) * 300).to(dtype) for n in SIZES]
    ref = sum(float(x.double().pow(2).sum()) for x in xs)
    # the kernel sums a tile's 8 squares per lane in fp32 before adding in double: <= 8 u relative
    assert cpu_adam.sumsq(xs) == pytest.approx(ref, rel=8 * U32)
    for bad in (float("inf"), float("nan")):
        ys = [x.clone() for x in xs]
        ys[-1][70000] = bad
        assert not torch.isfinite(torch.tensor(cpu_adam.sumsq(ys)))
