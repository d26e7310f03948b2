"""The flash section: memopt's Triton FlashAttention forward + backward against SDPA's flash backend, in a
subprocess of its own (``python -m memopt.gpu_check --flash-worker FILE``): errors against an fp32
reference, times, TFLOP/s and peak bytes of both."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from memopt.gpu_check.check import Check, SkipSection
from memopt.gpu_check.procs import kill_group, run_cmd, spawn, tail
from memopt.gpu_check.settings import FLASH_GROUPS, FLASH_NS, FLASH_QUEUED, FLASH_REPS, FLASH_TOKENS, FLASH_WARMUP


def flash_cases() -> list[tuple[str, int, int]]:
    return [(dt, d, n) for dt, d in FLASH_GROUPS for n in FLASH_NS]


def causal_flops(b: int, h: int, n: int, d: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs of causal attention: 2 matmuls of 2*N*N*D, half the tiles;
    the backward counts 2.5x the forward (5 matmuls against 2), FlashAttention's convention."""
    fwd = 4.0 * b * h * n * n * d * 0.5
    return fwd, 3.5 * fwd


def start_flash_warm(check: Check) -> None:
    """Compile the autotuned kernels of every (dtype, head dim) in the background (Triton's on-disk
    cache keeps them for the flash section's process)."""
    log = check.log_path("flash_warm")
    p = spawn([sys.executable, "-m", "memopt.gpu_check", "--flash-warm"], log, dict(os.environ, PYTHONUNBUFFERED="1"))
    check.background["flash_warm"] = (p, {"log": log, "t0": time.monotonic()})


def flash_warm() -> int:
    import torch

    from memopt.kernels.flash_attn import flash_attn

    for dt_name, d in FLASH_GROUPS:
        t0 = time.perf_counter()
        q, k, v = (torch.randn(1, 8, FLASH_NS[0], d, device="cuda", dtype=getattr(torch, dt_name), requires_grad=True)
                   for _ in range(3))
        flash_attn(q, k, v, causal=True).sum().backward()
        torch.cuda.synchronize()
        print(f"warm {dt_name} D={d}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def section_flash(check: Check, cap: float, rec: dict) -> dict:
    if check.mode != "cuda":
        raise SkipSection("no CUDA device: the Triton kernels are compared with SDPA's flash backend on a GPU only")
    t_start = time.monotonic()
    warm = check.background.get("flash_warm")
    if warm is not None:  # let the compile finish (it saves the time it takes), not past a third of the cap
        try:
            warm[0].wait(timeout=max(1.0, cap / 3))
        except subprocess.TimeoutExpired:
            kill_group(warm[0])
        rec["warm_s"] = round(time.monotonic() - warm[1]["t0"], 1)
    path = os.path.join(check.work, "flash.jsonl")
    if os.path.exists(path):
        os.remove(path)
    log = check.log_path("flash")
    cap = max(10.0, cap - (time.monotonic() - t_start))
    r = run_cmd([sys.executable, "-m", "memopt.gpu_check", "--flash-worker", path, "--cap", str(cap - 8)], cap, log,
                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    cases = []
    try:
        with open(path) as f:
            cases = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    res = {"cases": cases, "worker": r, "expected_cases": len(flash_cases()),
           "convention": "causal; fwd FLOPs 2*B*H*N*N*D (half of 4*B*H*N*N*D), fwd+bwd 3.5x fwd; times: median of "
                         f"{FLASH_REPS} after {FLASH_WARMUP} warm-ups (CUDA events), each over {FLASH_QUEUED} calls queued "
                         "back to back (*_isolated_ms: one call after an idle GPU, launch latency included); peak: max_memory_allocated during one "
                         "fwd+bwd (inputs and dO included); errors: max abs vs SDPA math backend on fp32 copies"}
    done = [c for c in cases if "memopt" in c]
    if r["rc"] != 0 or r["timed_out"] or len(done) < len(flash_cases()) or any(c.get("error") or (c.get("memopt") or {}).get("error") for c in cases):
        res["_status"] = "partial" if cases else "error"
        errors = [c.get("error") or (c.get("memopt") or {}).get("error") or (c.get("sdpa") or {}).get("error") for c in cases]
        errors = [e for e in errors if e]
        res["_note"] = (f"{len(done)} of {len(flash_cases())} cases measured; {len(errors)} with an error"
                        + (f", the first: {errors[0][:200]}" if errors else "")) if cases else tail(log, 300)
    return res


def flash_worker(path: str, cap: float, device: str = "cuda", cases=None, tokens: int = FLASH_TOKENS) -> int:
    """The flash section's cases, one JSON line each into ``path``. ``device="cpu"`` (with
    TRITON_INTERPRET=1, tiny fp32 cases) exercises the same code on a CPU for the tests."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memopt.kernels.flash_attn import flash_attn, tuned_blocks

    end = time.monotonic() + cap
    dev = torch.device(device)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in IEEE fp32 (the default, made sure)
    except Exception:  # noqa: BLE001  (a release that only takes fp32_precision: its default is IEEE too)
        pass

    def emit(rec):
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls = {"memopt": lambda q, k, v: flash_attn(q, k, v, causal=True), "sdpa": sdpa_flash}
    for dt_name, d, n in cases or flash_cases():
        if time.monotonic() > end - 3:
            emit({"dtype": dt_name, "head_dim": d, "n": n, "error": "not run: the section's cap was reached"})
            continue
        dtype = getattr(torch, dt_name)
        bh = max(1, tokens // n)
        h = min(8, bh)
        b = bh // h
        rec = {"dtype": dt_name, "head_dim": d, "n": n, "batch": b, "heads": h, "batch_heads": bh}
        try:
            g = torch.Generator(device=dev).manual_seed(n + d)
            q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=g) for _ in range(4))
            # fp32 reference, a few heads at a time (the math backend holds B*H*N*N fp32 scores and probs)
            ref = {key: torch.empty(b, h, n, d, device=dev, dtype=torch.float32) for key in ("out", "dq", "dk", "dv")}
            step = max(1, (1 << 30) // (n * n * 4))
            for bi in range(b):
                for h0 in range(0, h, step):
                    sl = (slice(bi, bi + 1), slice(h0, h0 + step))
                    qf, kf, vf = (t[sl].float().requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(SDPBackend.MATH):
                        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
                    o.backward(do[sl].float())
                    ref["out"][sl], ref["dq"][sl], ref["dk"][sl], ref["dv"][sl] = o.detach(), qf.grad, kf.grad, vf.grad
                    del qf, kf, vf, o
            _empty_cache(dev)
            rec["ref_max_abs"] = {key: float(t.abs().max()) for key, t in ref.items()}
            fwd_flops, fb_flops = causal_flops(b, h, n, d)
            for name, fn in impls.items():
                rec[name] = _bench_one(fn, q, k, v, do, ref, fwd_flops, fb_flops)
            rec["memopt_tiles"] = tuned_blocks()
            try:  # a measurement beside the case's: its failure is its own
                rec["memopt_host_split"] = _host_split(q, k, v, do)
            except Exception as exc:  # noqa: BLE001
                rec["memopt_host_split"] = {"error": f"{type(exc).__name__}: {exc}"}
            m, s = rec["memopt"], rec["sdpa"]
            if not m.get("error") and not s.get("error"):
                rec["memopt_err_over_sdpa_err"] = {key: (m["max_abs_err"][key] / s["max_abs_err"][key]) if s["max_abs_err"][key] else None
                                                   for key in m["max_abs_err"]}
                rec["speedup_sdpa_over_memopt_fwdbwd"] = m["fwdbwd_ms"] / s["fwdbwd_ms"] if s["fwdbwd_ms"] else None
            del ref
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"
        emit(rec)
        _empty_cache(dev)
    return 0


def _host_split(q, k, v, do) -> dict:
    """memopt's host time per forward + backward, queued as in ``_bench_one``: through autograd (``flash_attn``:
    the validation, the autograd Function, autograd's engine calling the Python backward) and the launchers
    alone (``_flash_forward`` and ``_flash_backward`` called directly). Why: at N = 1k the call is bound by the
    host, and on the H200 at D = 64 its backward took 0.52-0.64 ms of host time against SDPA's 0.30-0.47
    (seventh check); the split says whether autograd's side or the launches hold the difference. A third timing,
    ``python``, runs the launchers with ``launch_cache.launch`` a no-op: memopt's own Python (allocations, arguments,
    nothing launched), so the launchers' time less it is Triton's launch path (compiled kernels only: the
    interpreter's launches do not go through the cache)."""
    import math

    from memopt.kernels import flash_attn as fa
    from memopt.kernels import launch_cache

    scale = 1.0 / math.sqrt(q.shape[-1])
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def through():
        qq.grad = kk.grad = vv.grad = None
        fa.flash_attn(qq, kk, vv, causal=True).backward(do)

    def direct():
        o, lse = fa._flash_forward(q, k, v, True, scale)
        fa._flash_backward(do, q, k, v, o, lse, True, scale)

    def python_only():
        real = launch_cache.launch
        launch_cache.launch = lambda *a, **k: None
        try:
            direct()
        finally:
            launch_cache.launch = real

    out = {}
    for name, f in (("autograd", through), ("launchers", direct), ("python", python_only)):
        f()
        _sync(q.device)
        host: list[float] = []
        _timed(f, q.device, queued=True, host=host)
        out[f"{name}_host_ms"] = _median(host)
    return out


def _median(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 2]


def _timed(f, dev, queued: bool, host: list[float] | None = None) -> float:
    """Median of FLASH_REPS timings, ms per call. Isolated: one call between two events, the GPU idle before it,
    so the host's launch latency counts. Queued: FLASH_QUEUED calls back to back between two events (per call),
    the GPU kept busy as in training, so only GPU time counts unless the host is slower than the GPU: the host's
    own time per queued call (launching, before the synchronize) goes into ``host`` (above the queued time, the
    call is bound by the host). On a CPU both are the wall time."""
    import torch

    ts = []
    calls = FLASH_QUEUED if queued else 1
    for _ in range(FLASH_REPS):
        if dev.type == "cuda":
            a, b_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t_host = time.perf_counter()
        for _ in range(calls):
            f()
        host_ms = 1e3 * (time.perf_counter() - t_host) / calls
        if queued and host is not None:
            host.append(host_ms)
        if dev.type == "cuda":
            b_.record()
            torch.cuda.synchronize(dev)
            ts.append(a.elapsed_time(b_) / calls)
        else:
            ts.append(host_ms)
    return _median(ts)


def _empty_cache(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _bench_one(fn, q, k, v, do, ref, fwd_flops, fb_flops) -> dict:
    import torch

    dev = q.device
    out: dict = {}
    try:
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def fwdbwd():
            qq.grad = kk.grad = vv.grad = None
            o = fn(qq, kk, vv)
            o.backward(do)
            return o

        t0 = time.perf_counter()
        o = fwdbwd()
        _sync(dev)
        out["first_call_s"] = round(time.perf_counter() - t0, 3)  # compile + autotune included
        out["max_abs_err"] = {
            "out": float((o.detach().float() - ref["out"]).abs().max()),
            "dq": float((qq.grad.float() - ref["dq"]).abs().max()),
            "dk": float((kk.grad.float() - ref["dk"]).abs().max()),
            "dv": float((vv.grad.float() - ref["dv"]).abs().max()),
        }
        del o
        for _ in range(FLASH_WARMUP):
            fwdbwd()
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            fwdbwd()
            torch.cuda.synchronize(dev)
            out["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            out["peak_over_start_bytes"] = out["peak_bytes"] - base

        host: dict[str, list[float]] = {"fwd": [], "fwdbwd": []}

        with torch.no_grad():
            for _ in range(FLASH_WARMUP):
                fn(q, k, v)
            fwd = lambda: fn(q, k, v)  # noqa: E731
            out["fwd_ms"] = _timed(fwd, dev, queued=True, host=host["fwd"])
            out["fwd_isolated_ms"] = _timed(fwd, dev, queued=False)
        out["fwdbwd_ms"] = _timed(fwdbwd, dev, queued=True, host=host["fwdbwd"])
        out["fwdbwd_isolated_ms"] = _timed(fwdbwd, dev, queued=False)
        if dev.type == "cuda":  # on a CPU the host time is the time
            out.update({f"{name}_host_ms": _median(ms) for name, ms in host.items()})
        out["fwd_tflops"] = fwd_flops / (out["fwd_ms"] * 1e-3) / 1e12
        out["fwdbwd_tflops"] = fb_flops / (out["fwdbwd_ms"] * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out
