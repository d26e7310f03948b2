"""Where a short-sequence FlashAttention call spends its time on a GPU: kernels or the host's launches.

The GPU check found memopt's kernels slower than SDPA's flash backend at N = 1024 while faster at 4k
and 16k, with a floor of ~0.9 ms per forward + backward at both 1k and 4k (D = 64): the signature of
a host-bound call. This script separates the two for one shape, memopt against SDPA:

* GPU time per kernel (``torch.profiler``, CUDA activity): what the kernels cost with the host out of
  the way;
* host time per call (``time.perf_counter`` over calls launched without synchronizing: the Python
  wrappers, autograd, the launchers), and where it goes (``cProfile``, top entries);
* wall time per call, queued, as the GPU check measures it.

Usage (a CUDA machine): ``python experiments/flash_attn/launch_profile.py OUT_DIR [--n 1024 --d 64]``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from memopt.kernels.flash_attn import flash_attn, tuned_blocks  # noqa: E402


def sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def memopt(q, k, v):
    return flash_attn(q, k, v, causal=True)


def fwdbwd(fn, q, k, v, do):
    q.grad = k.grad = v.grad = None
    fn(q, k, v).backward(do)


def host_ms(f, calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        f()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return host


def wall_ms(f, calls: int) -> float:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def kernel_ms(f, calls: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key[:80]] = round(t / calls / 1e3, 4)
    return out


def top(f, calls: int, n: int = 18) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        f()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--bh", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dt = getattr(torch, args.dtype)
    h = min(8, args.bh)
    q, k, v, do = (torch.randn(args.bh // h, h, args.n, args.d, device="cuda", dtype=dt) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    res = {"shape": [args.bh // h, h, args.n, args.d], "dtype": args.dtype, "device": torch.cuda.get_device_name()}
    report = []
    for name, fn in (("memopt", memopt), ("sdpa", sdpa)):
        fb = lambda fn=fn: fwdbwd(fn, q, k, v, do)  # noqa: E731
        with torch.no_grad():
            fw = lambda fn=fn: fn(q, k, v)  # noqa: E731
            for _ in range(3):
                fw()
            r = {"fwd_host_ms": host_ms(fw, 50), "fwd_wall_ms": wall_ms(fw, 50), "fwd_kernels_ms": kernel_ms(fw, 20)}
        for _ in range(3):
            fb()
        r.update(fwdbwd_host_ms=host_ms(fb, 50), fwdbwd_wall_ms=wall_ms(fb, 50), fwdbwd_kernels_ms=kernel_ms(fb, 20))
        r["fwdbwd_kernel_sum_ms"] = round(sum(r["fwdbwd_kernels_ms"].values()), 4)
        res[name] = r
        report.append(f"== {name}: cProfile of 20 fwd+bwd calls (host side)\n" + top(fb, 20))
    res["memopt_tiles"] = tuned_blocks()
    with open(os.path.join(args.out, "launch_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "launch_profile.txt"), "w") as f:
        f.write("\n".join(report))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
